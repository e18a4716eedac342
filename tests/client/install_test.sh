#!/bin/bash
# install_test.sh BUILD_DIR CONSUMER_SRC: installs the build into a temporary prefix, builds the consumer
# project against the installed libkvd twice (CMake package kvd::client, and pkg-config kvd.pc), starts
# the installed kvd on the host backend and runs both consumers against it.
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d /tmp/kvd-install-test-XXXXXX)
kvd_pid=
cleanup() {
  if [[ -n "$kvd_pid" ]]; then kill -TERM "$kvd_pid" 2>/dev/null || true; wait "$kvd_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

cmake --install "$build" --prefix "$tmp/prefix" > "$tmp/install.log"
test -f "$tmp/prefix/lib/libkvd.a"
test -f "$tmp/prefix/include/kvd/client.h"
test -f "$tmp/prefix/include/kvd/group.h"
test -f "$tmp/prefix/lib/cmake/kvd/kvdConfig.cmake"
test -f "$tmp/prefix/lib/pkgconfig/kvd.pc"
test -x "$tmp/prefix/bin/kvctl"
# The public header pulls in no generated proto types.
if grep -q "pb.h" "$tmp/prefix/include/kvd/client.h" "$tmp/prefix/include/kvd/group.h"; then echo "a public header includes generated code"; exit 1; fi

cmake -S "$src" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" > "$tmp/configure.log"
cmake --build "$tmp/consumer" -j2 > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" c++ -std=c++20 -o "$tmp/consumer-pc" "$src/main.cc" \
  $(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs kvd)

sock="$tmp/gpu0.sock"
"$tmp/prefix/bin/kvd" --backend=host --socket="$sock" --host-capacity=256MiB --budget=128MiB > "$tmp/kvd.log" 2>&1 &
kvd_pid=$!
for _ in $(seq 1 1500); do
  grep -q " ready: " "$tmp/kvd.log" && break
  kill -0 "$kvd_pid" 2>/dev/null || { cat "$tmp/kvd.log"; exit 1; }
  sleep 0.02
done
grep -q " ready: " "$tmp/kvd.log" || { echo "kvd did not become ready"; cat "$tmp/kvd.log"; exit 1; }
"$tmp/consumer/consumer" "$sock"
"$tmp/consumer-pc" "$sock"
"$tmp/prefix/bin/kvctl" --socket="$sock" pools
echo "install test passed"
