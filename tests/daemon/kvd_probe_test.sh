#!/usr/bin/env bash
# kvd_probe against a real kvd on the host backend: one process creates and grows a pool, two more
# attach it, map it and see each other's bytes. Usage: kvd_probe_test.sh KVD KVD_PROBE
set -euo pipefail
kvd=$1 probe=$2
dir=$(mktemp -d)
cleanup() { kill "${daemon:-}" "${holder:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
"$kvd" --backend=host --socket="$dir/gpu0.sock" --host-capacity=256MiB --budget=200MiB >"$dir/kvd.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do [[ -S $dir/gpu0.handles ]] && break; sleep 0.1; done
"$probe" --socket="$dir/gpu0.sock" create p --bytes=64MiB
"$probe" --socket="$dir/gpu0.sock" attach p --write=7 --wait-for=9 &
holder=$!
# The second process may attach before the first has written: retry the check a few times.
for attempt in $(seq 50); do
  if "$probe" --socket="$dir/gpu0.sock" attach p --expect=7 --write=9 2>"$dir/err"; then break; fi
  grep -q "pattern 7 not found" "$dir/err" || { cat "$dir/err"; exit 1; }
  sleep 0.1
  [[ $attempt == 50 ]] && { cat "$dir/err"; exit 1; }
done
wait "$holder"
holder=
kill -TERM "$daemon"
wait "$daemon"
daemon=
echo "kvd_probe_test: 1 passed, 0 failed"
