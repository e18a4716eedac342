#!/bin/bash
# install_test.sh BUILD_DIR CONSUMER_SRC: installs the build into a temporary prefix, builds the consumer
# project against the installed libkvd twice (CMake package kvd::client and kvd::c, and pkg-config kvd.pc and
# kvd_c.pc), installs the assembled Python package with pip into a virtual environment, starts the installed
# kvd on the host backend and runs every consumer against it.
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
test -f "$tmp/prefix/include/kvd/kvd.h"
test -L "$tmp/prefix/lib/libkvd_c.so" && test -f "$tmp/prefix/lib/libkvd_c.so.1"
test -f "$tmp/prefix/lib/pkgconfig/kvd_c.pc"
test -f "$tmp/prefix/share/kvd/proto/kvd/v1/kvd.proto"
# The C API's library exports the C API only.
if nm -D --defined-only "$tmp/prefix/lib/libkvd_c.so.1" | awk '$2 ~ /[TDBR]/ && $3 !~ /^kvd_/' | grep -q .; then
  echo "libkvd_c.so exports more than kvd_*"; exit 1
fi
test -f "$tmp/prefix/lib/cmake/kvd/kvdConfig.cmake"
test -f "$tmp/prefix/lib/pkgconfig/kvd.pc"
test -x "$tmp/prefix/bin/kvctl"
# The public header pulls in no generated proto types.
if grep -q "pb.h" "$tmp/prefix/include/kvd/client.h" "$tmp/prefix/include/kvd/group.h"; then echo "a public header includes generated code"; exit 1; fi

cmake -S "$src" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" > "$tmp/configure.log"
cmake --build "$tmp/consumer" -j2 > "$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" c++ -std=c++20 -o "$tmp/consumer-pc" "$src/main.cc" \
  $(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs kvd)
PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" cc -std=c11 -o "$tmp/consumer-c-pc" "$src/main_c.c" \
  $(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs kvd_c)
# The Python package, as a user installs it: pip, from (a copy of: pip builds in it) the assembled directory,
# nothing downloaded.
/usr/bin/python3 -m venv --system-site-packages "$tmp/venv"
cp -a "$build/client/python/package" "$tmp/package"
"$tmp/venv/bin/pip" install --no-deps --no-build-isolation --no-index -q "$tmp/package" \
  > "$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log"; exit 1; }

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
"$tmp/consumer/consumer_c" "$sock"
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/consumer-c-pc" "$sock"
(cd "$tmp" && env -u KVD_LIBRARY -u PYTHONPATH -u KVD_PYTHON_GEN_DIR "$tmp/venv/bin/python" - "$sock" <<'PY'
import os, sys
import kvd
assert os.path.dirname(kvd._lib.lib._name) == os.path.dirname(kvd.__file__), kvd._lib.lib._name  # its own library
with kvd.connect(sys.argv[1], client_name="consumer-py") as c:
    c.create_pool("consumer-py", layers=2, capacity_blocks=1024, heads=2, block_tokens=16, channels=64,
                  element_bytes=2, initial_blocks=512)
    with c.attach("consumer-py") as m:
        m.layer(1)[3] = 7
        assert float(m.layer(1)[3].max()) == 7.0
        c.grow("consumer-py", 1024)
        assert m.committed_blocks == 1024
    print("consumer_py: pool consumer-py,", m.geometry.layout, "from", kvd.__file__)
    c.delete("consumer-py")
PY
)
"$tmp/prefix/bin/kvctl" --socket="$sock" pools
echo "install test passed"
