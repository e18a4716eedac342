#!/usr/bin/env bash
# kvd_group_bench against two real kvds on the host backend (devices 0 and 1 of one "node"): it runs,
# prints a row per operation, cleans its pools up, and its --json parses. A smoke test: no timing is
# checked. Usage: group_bench_test.sh KVD KVD_GROUP_BENCH
set -euo pipefail
kvd=$1 bench=$2
dir=$(mktemp -d)
cleanup() { kill "${d0:-}" "${d1:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
"$kvd" --backend=host --device=0 --socket="$dir/gpu0.sock" --host-capacity=1GiB --budget=600MiB >"$dir/kvd0.log" 2>&1 &
d0=$!
"$kvd" --backend=host --device=1 --socket="$dir/gpu1.sock" --host-capacity=1GiB --budget=600MiB >"$dir/kvd1.log" 2>&1 &
d1=$!
for _ in $(seq 100); do [[ -S $dir/gpu0.handles && -S $dir/gpu1.handles ]] && break; sleep 0.1; done
"$bench" --sockets="$dir/gpu0.sock,$dir/gpu1.sock" --bytes=512MiB --rounds=2 | tee "$dir/out.txt"
for op in grow shrink sleep wake; do grep -q "^$op " "$dir/out.txt" || { echo "no $op row"; exit 1; }; done
"$bench" --sockets="$dir/gpu0.sock,$dir/gpu1.sock" --bytes=256MiB --rounds=1 --json >"$dir/out.json"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert [r["op"] for r in d["results"]] == ["grow","shrink","sleep","wake"], d' "$dir/out.json"
# Nothing left behind on either daemon.
grep -q "deleted pool bench-" "$dir/kvd0.log" && grep -q "deleted pool bench-" "$dir/kvd1.log"
if "$bench" --sockets="$dir/gpu9.sock" 2>"$dir/err"; then echo "a missing daemon must fail"; exit 1; fi
grep -q "gpu9.sock" "$dir/err"
if "$bench" --sockets="$dir/gpu0.sock" --bytes=8MiB 2>"$dir/err"; then echo "a pool of one granule must fail"; exit 1; fi
grep -q -- "--bytes: at least" "$dir/err"
echo "group_bench_test: 1 passed, 0 failed"
