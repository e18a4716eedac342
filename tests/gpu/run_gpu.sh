#!/usr/bin/env bash
# The GPU run: everything that needs a GPU, in one go, on a machine that has the programs of a CUDA
# build bundled by tests/gpu/bundle.sh (see docs/gpu.md). Writes logs to $OUT (or ./gpu-out).
#   tests/gpu/run_gpu.sh BUNDLE_DIR [POOL_SIZE]
# STEPS="device daemon durable restart reshape release group python connectors" (the default) picks steps;
# "bench" (kvd_bench's chunk sweep and lifecycle, the step's 9 minutes), "engines" (kvd.torch,
# kvd.transformers: docs/engines.md), "arbitrate" (kvd_bench's reclaim and saturate lines) and "keep" (a sleep
# that keeps 64 GiB in the host tier, checked by two torch engines) and "node" (one kvd per GPU: groups, peer
# mappings, restarts and reclaim across the node; for nvidia-h200-x2) run only when named: STEPS=bench,
# STEPS=engines, STEPS=arbitrate, STEPS=keep, STEPS=node.
#
# Each step runs in a session of its own (setsid) under a wall-clock limit (its entry in `limit` below,
# STEP_LIMIT_S for all; the whole run stops starting steps once RUN_BUDGET_S, default 560 s, is spent).
# When the step ends -- passed, failed or timed out -- every process left in its session and every process
# of this run that escaped it (they carry KVD_GPU_RUN=<this run's id> in their environment) gets SIGTERM,
# then SIGKILL 10 s later. Before each step the GPU must be back at the memory it used when the run began
# (within GPU_SLACK_MIB, default 1024): the run waits for it up to 20 s, then names what holds memory
# (nvidia-smi --query-compute-apps), kills what this run started and waits again. One failing step
# therefore leaves nothing behind for the next.
set -uo pipefail
bundle=${1:?usage: run_gpu.sh BUNDLE_DIR [POOL_SIZE]}
pool_size=${2:-100GiB}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
source "$bundle/env.sh"
status=0
step() { printf '\n=== %s\n' "$*"; }
run() {  # run NAME CMD...: log to $out/NAME.log, echo the tail, remember failures
  local name=$1; shift
  step "$name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$out/$name.log"
  ((rc == 0)) || { echo "!!! $name exited $rc"; status=1; }
}
left() {  # seconds this step has left, less 15 s for its cleanup: the limit of one command of the step
  local s=$((${RUN_GPU_DEADLINE:-0} - $(date +%s) - 15))
  echo $((s > 10 ? s : 10))
}

step_device() {
run conformance device_conformance_test --gtest_filter='*/cuda:*/host' --gtest_color=no
run cuda_device cuda_device_test --gtest_color=no
TAIL=45 run device_bench bash -c "kvd_device_bench --backend=cuda --json >$out/bench.json"
}

step_daemon() {
step "kvd on CUDA: a ${pool_size} pool attached by two more processes"
dir=$(mktemp -d)
kvd --backend=auto --socket="$dir/gpu0.sock" --log-level=info >"$out/kvd.log" 2>&1 &
daemon=$!
for _ in $(seq 300); do [[ -S $dir/gpu0.handles ]] && break; sleep 0.1; done
head -n 3 "$out/kvd.log"
kvd_probe --socket="$dir/gpu0.sock" create big --bytes="$pool_size" || status=1
kvd_probe --socket="$dir/gpu0.sock" attach big --write=7 --wait-for=9 >"$out/holder.log" 2>&1 &
holder=$!
for attempt in $(seq 100); do
  kvd_probe --socket="$dir/gpu0.sock" attach big --expect=7 --write=9 2>"$out/reader.err" && break
  grep -q "pattern 7 not found" "$out/reader.err" || { cat "$out/reader.err"; status=1; break; }
  sleep 0.2
done
wait "$holder" || status=1
cat "$out/holder.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
kill -TERM "$daemon"
wait "$daemon"
echo "kvd exited $?"
tail -n 8 "$out/kvd.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
rm -rf "$dir"
}

step_durable() {
step "durable pools on CUDA: a ${pool_size} pool across a SIGTERM and a SIGKILL restart under a played systemd"
PYTHONPATH=$bundle TAIL=40 run durable timeout "$(left)" python3 "$bundle/durable_gpu.py" "$bundle/bin" "$out" "$pool_size"
}

step_restart() {
step "durable pools on CUDA: a ${pool_size} pool mapped by two torch engines that keep writing across a SIGTERM and a kill -9 of kvd"
PYTHONPATH=$bundle/python:$bundle TAIL=40 run restart timeout "$(($(left) / 2))" python3 "$bundle/restart_torch.py" "$bundle/bin" "$out" "$pool_size"
step "the same without the FD store: the engines hand their chunks back after each restart"
PYTHONPATH=$bundle/python:$bundle TAIL=40 run restart_clients timeout "$(left)" python3 "$bundle/restart_torch.py" "$bundle/bin" "$out" "$pool_size" --fdstore=no
}

step_reshape() {
step "elastic shape on CUDA: a pool grown in 1 GiB steps up to ${pool_size}, two pausing torch engines, compact, then an exact shrink to half"
PYTHONPATH=$bundle/python:$bundle TAIL=40 run reshape timeout "$(left)" python3 "$bundle/reshape_torch.py" "$bundle/bin" "$out" "$pool_size"
}

step_release() {
step "releases under running engines on CUDA: a ${pool_size} pool, two torch engines looping kernels over it (pausable, then not),
    the GPU filled to 97%; kvctl shrink --whole-chunks, exact shrink, compact, sleep --wait, wake, delete --force; refused and forced"
PYTHONPATH=$bundle/python:$bundle TAIL=60 run release timeout "$(left)" python3 "$bundle/release_torch.py" "$bundle/bin" "$out" "$pool_size"
}

step_group() {
step "one kvd per device: --list-devices, --device by UUID, an engine group over two daemons"
# This node may have one GPU: both daemons then serve GPU 0, which exercises the group protocol on
# CUDA memory (the multi-GPU case differs only in which device each daemon opens).
run list_devices kvd --backend=cuda --list-devices --json
uuid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["devices"][0]["uuid"])' "$out/list_devices.log")
ngpu=$(nvidia-smi -L | wc -l)
dir=$(mktemp -d)
kvd --backend=cuda --device="${uuid:0:12}" --socket="$dir/gpu0.sock" --budget=40GiB >"$out/kvd-group0.log" 2>&1 &
d0=$!
second=$((ngpu > 1 ? 1 : 0))
kvd --backend=cuda --device="$second" --socket="$dir/gpu1.sock" --budget=20GiB >"$out/kvd-group1.log" 2>&1 &
d1=$!
for _ in $(seq 300); do [[ -S $dir/gpu0.handles && -S $dir/gpu1.handles ]] && break; sleep 0.1; done
grep -h "ready" "$out/kvd-group0.log" "$out/kvd-group1.log"
# 1 MiB blocks; 32 GiB of VA a rank.
dims=(--layers=32 --capacity-blocks=32768 --heads=8 --block-tokens=16 --channels=128 --element-bytes=2)
run group_create0 kvctl --socket="$dir/gpu0.sock" create llama-r0 "${dims[@]}" --group=llama --rank=0 --group-size=2
run group_create1 kvctl --socket="$dir/gpu1.sock" create llama-r1 "${dims[@]}" --group=llama --rank=1 --group-size=2
run group_grow kvctl group grow llama --bytes=16GiB --socket-dir="$dir"
run group_status kvctl group status llama --socket-dir="$dir"
# 24 GiB a rank fits the first daemon's budget (40 GiB) but not the second's (20 GiB): no rank may change.
step "group grow past one rank's budget: refused, every rank unchanged"
kvctl group grow llama --bytes=24GiB --socket-dir="$dir" && status=1
run group_status_after kvctl --json group status llama --socket-dir="$dir"
grep -q '"consistent": true' "$out/group_status_after.log" || status=1
grep -c '"committed_blocks": "16384"' "$out/group_status_after.log"  # proto3 JSON: 64-bit integers are strings
nvidia-smi --query-gpu=memory.used --format=csv,noheader
run group_sleep kvctl group sleep llama --wait --socket-dir="$dir"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
run group_wake kvctl group wake llama --socket-dir="$dir"
run group_json kvctl --json group grow llama --bytes=18GiB --socket-dir="$dir"
grep -E '"(prepare_us|commit_us|prepared_bytes|round_trip_ms)"' "$out/group_json.log"
# The grown rank's memory is real and shared: one process writes, another reads it back.
kvd_probe --socket="$dir/gpu0.sock" attach llama-r0 --write=5 --wait-for=6 >"$out/group-holder.log" 2>&1 &
holder=$!
for attempt in $(seq 100); do
  kvd_probe --socket="$dir/gpu0.sock" attach llama-r0 --expect=5 --write=6 2>"$out/group-reader.err" && break
  grep -q "pattern 5 not found" "$out/group-reader.err" || { cat "$out/group-reader.err"; status=1; break; }
  sleep 0.2
done
wait "$holder" || status=1
cat "$out/group-holder.log"
kvctl --socket="$dir/gpu0.sock" delete llama-r0 >/dev/null && kvctl --socket="$dir/gpu1.sock" delete llama-r1 >/dev/null
TAIL=10 run group_bench kvd_group_bench --sockets="$dir/gpu0.sock,$dir/gpu1.sock" --bytes=16GiB --rounds=5
kill -TERM "$d0" "$d1"
wait "$d0"; echo "kvd (group rank 0) exited $?"
wait "$d1"; echo "kvd (group rank 1) exited $?"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
rm -rf "$dir"
}

step_python() {
  step "Python package on CUDA: torch views shared by two processes, grow, sleep/wake; kvctl"
  dir=$(mktemp -d)
  kvd --backend=cuda --socket="$dir/gpu0.sock" --budget=16GiB --metrics-address=127.0.0.1:9500 \
    >"$out/kvd-python.log" 2>&1 &
  daemon=$!
  for _ in $(seq 300); do [[ -S $dir/gpu0.handles ]] && break; sleep 0.1; done
  export KVD_SOCKET=$dir/gpu0.sock PYTHONPATH=$bundle/python
  python3 -c 'import sys, torch, kvd, kvd._lib as l; print("python", sys.version.split()[0], "torch", torch.__version__, "kvd C API", l.lib.kvd_api_version(), "from", l.lib._name)'
  run engine_worker timeout "$(left)" python3 "$bundle/python/examples/engine_worker.py" --layers 32
  run cuda_check timeout "$(left)" python3 "$bundle/kvd_cuda_check.py"
  # Tensor-parallel ranks as one group, torch views on CUDA: two more kvds (both on GPU 0 on a
  # one-GPU node), the second with a small budget for the demonstrated all-or-nothing failure.
  tp=$(mktemp -d)
  second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
  kvd --backend=cuda --device=0 --socket="$tp/gpu0.sock" --budget=8GiB >"$out/kvd-tp0.log" 2>&1 &
  tp0=$!
  kvd --backend=cuda --device="$second" --socket="$tp/gpu1.sock" --budget=2GiB >"$out/kvd-tp1.log" 2>&1 &
  tp1=$!
  for _ in $(seq 300); do [[ -S $tp/gpu0.handles && -S $tp/gpu1.handles ]] && break; sleep 0.1; done
  TAIL=40 run tp_group timeout "$(left)" python3 "$bundle/python/examples/tp_group.py" --socket-dir "$tp" --ranks 2 --demo-failure
  kill -TERM "$tp0" "$tp1"
  wait "$tp0" "$tp1"
  rm -rf "$tp"
  if command -v kvctl >/dev/null; then
    run kvctl_create kvctl create demo --layers=32 --capacity-blocks=8192 --heads=8 --block-tokens=16 --channels=128 --element-bytes=2
    run kvctl_grow kvctl grow demo --bytes=8GiB
    run kvctl_pools kvctl pools
    run kvctl_status kvctl status
    run kvctl_sleep kvctl sleep --all
    run kvctl_wake kvctl wake --all
    run kvctl_json kvctl --json describe demo
    step "metrics scraped from the CUDA daemon"
    python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9500/metrics").read().decode())' |
      grep -E '^kvd_(device_|pool_committed_bytes|pool_state)' || status=1
  fi
  kill -TERM "$daemon"
  wait "$daemon"
  echo "kvd exited $?"
  rm -rf "$dir"
}

step_engines() {
  # Engines on kvd (docs/engines.md): kvd.torch's MemPool under a torch program, then a transformers Llama through
  # kvd.transformers.KvdCache against DynamicCache (it starts its own kvd; it says SKIPPED without transformers).
  step "engines: kvd.torch's MemPool (allocate, share, sleep/wake, adopt after an engine restart); a transformers Llama
    through kvd.transformers.KvdCache, identical to DynamicCache through grows, compaction, kvd and engine restarts, sleep/wake"
  dir=$(mktemp -d)
  kvd --backend=cuda --socket="$dir/gpu0.sock" --budget=16GiB >"$out/kvd-engines-torch.log" 2>&1 &
  daemon=$!
  for _ in $(seq 300); do [[ -S $dir/gpu0.handles ]] && break; sleep 0.1; done
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -n 1
  KVD_SOCKET=$dir/gpu0.sock PYTHONPATH=$bundle/python TAIL=30 run engines_torch timeout "$(($(left) / 3))" \
    python3 "$bundle/engines_torch.py"
  kill -TERM "$daemon"
  wait "$daemon"
  echo "kvd exited $?"
  rm -rf "$dir"
  PYTHONPATH=$bundle/python TAIL=40 run engines_transformers timeout "$(left)" python3 "$bundle/engines_transformers.py" \
    "$bundle/bin" "$out"
}

step_bench() {
  # docs/benchmarks.md. BENCH_PARTS (default "sweep main") picks the parts, in this order:
  #   sweep  kvd_bench --chunk-sweep: the chunk sizes through the device layer, no kvd (KVD_SWEEP_ARGS adds
  #          flags); at most 200 s; table in kvd_chunk_sweep.log, JSON in kvd_chunk_sweep.json.
  #   main   kvd_bench against its own kvd on CUDA (128 GiB as 80 segments), --sections=KVD_BENCH_SECTIONS
  #          (default lifecycle: the lifecycle lines with the raw calls and the in-process peers, 9 repetitions),
  #          KVD_BENCH_ARGS adds flags; --deadline-s is what the step has left less 30 s, so that it stops
  #          starting repetitions in time (config.lifecycle_reps says how many ran). Table in kvd_bench.log,
  #          JSON in kvd_bench.json.
  #   keep   kvd_bench --sections=keep --keep-bytes=KVD_KEEP_BYTES (default 64GiB; its kvd gets a host tier of that
  #          size): a sleep that keeps the contents and the wake that copies them back, against the same copies to
  #          registered memory in-process (issue 24: <= 1.4 s each, <= 1.10x). Table in kvd_bench_keep.log.
  local parts=" ${BENCH_PARTS:-sweep main} "
  if [[ $parts == *" sweep "* ]]; then
    local sweep_s=$(($(left) < 200 ? $(left) : 200))
    TAIL=50 run kvd_chunk_sweep timeout "$sweep_s" bash -c \
      "kvd_bench --backend=cuda --chunk-sweep --json ${KVD_SWEEP_ARGS:-} >$out/kvd_chunk_sweep.json"
  fi
  if [[ $parts == *" main "* ]]; then
    local deadline=$(($(left) - 30))
    TAIL=80 run kvd_bench timeout "$(left)" bash -c "kvd_bench --backend=cuda --json \
      --sections=${KVD_BENCH_SECTIONS:-lifecycle} --deadline-s=$((deadline > 1 ? deadline : 1)) ${KVD_BENCH_ARGS:-} \
      >$out/kvd_bench.json"
  fi
  if [[ $parts == *" keep "* ]]; then
    TAIL=20 run kvd_bench_keep timeout "$(left)" bash -c "kvd_bench --backend=cuda --json --sections=keep \
      --keep-bytes=${KVD_KEEP_BYTES:-64GiB} ${KVD_BENCH_ARGS:-} >$out/kvd_bench_keep.json"
  fi
}

step_arbitrate() {
  # Issue 23 through the Python package and torch (arbitrate_torch.py): A holds ${pool_size} with 20% of its blocks
  # live, B asks for 40% of it with wait and A's on_reclaim gives back; B's grow with phases, A's live bytes on the
  # GPU; then 8 engines at once to saturation with zero driver out-of-memory errors.
  PYTHONPATH=$bundle/python:$bundle TAIL=20 run arbitrate_torch timeout "$(($(left) / 2))" python3 \
    "$bundle/arbitrate_torch.py" "$bundle/bin" "$out" "$pool_size"
  # The same through libkvd in kvd_bench (docs/benchmarks.md, "reclaim"): engine A (priority 0) holds ${pool_size} grown in ten steps with 20%
  # of its blocks live and a pattern in them, a filler takes the rest of what the device can back, engine B
  # (priority 10) asks for 40% of A with wait: kvd asks A, A's on_reclaim shrinks with its live blocks, B is
  # admitted. B's grow time and its phases (to_ask, give_to_reply) against the same moves by hand
  # (ShrinkForReclaim of A by an operator, then B's grow), and A's live samples byte for byte after every
  # round. Then 8 engines growing at once to saturation: driver out-of-memory errors (target 0).
  TAIL=40 run arbitrate bash -c "kvd_bench --backend=cuda --sections=reclaim,saturate --bytes=${pool_size} --json \
    ${KVD_BENCH_ARGS:-} >$out/arbitrate.json"
}

step_keep() {
  # Issue 24 (keep_torch.py): a pool of KVD_KEEP_BYTES (default 64 GiB) on a kvd with a host tier of that size, two
  # torch engines filling every byte of half of its layers each; a sleep that keeps the contents and the wake
  # that copies them back, timed (<= 1.4 s each), and every byte compared by the engines on the GPU. Then
  # kvd_bench's keep lines against the same copies to registered memory in-process (<= 1.10x).
  PYTHONPATH=$bundle/python:$bundle TAIL=10 run keep_torch timeout "$(($(left) / 2))" python3 \
    "$bundle/keep_torch.py" "$bundle/bin" "$out" "${KVD_KEEP_BYTES:-64GiB}"
  TAIL=10 run kvd_bench_keep timeout "$(left)" bash -c "kvd_bench --backend=cuda --json --sections=keep \
    --keep-bytes=${KVD_KEEP_BYTES:-64GiB} ${KVD_BENCH_ARGS:-} >$out/kvd_bench_keep.json"
}

step_node() {
  # The two-GPU run (node_torch.py, docs/gpu.md "Two GPUs"): one kvd per GPU under played service managers, a
  # two-rank group written and checked by torch engines on both GPUs through a group grow and shrink, per-rank
  # compaction and exact shrink, a group sleep keeping the contents and the wake; a peer mapping from GPU 1
  # through a compaction and a SIGKILL of GPU 0's kvd; both kvds SIGKILLed mid-prepare; a reclaim on GPU 0 that
  # never asks GPU 1. On a node with one GPU both kvds serve GPU 0 and the peer part says SKIPPED.
  PYTHONPATH=$bundle/python:$bundle TAIL=20 run node_torch timeout "$(left)" python3 \
    "$bundle/node_torch.py" "$bundle/bin" "$out" "${KVD_NODE_BYTES:-32GiB}"
}

step_connectors() {
step "connectors: probed capabilities, transfer descriptors, DMA-BUF range FDs of ${pool_size} pools in another process"
dir=$(mktemp -d)
sock=$dir/gpu0.sock
kvd --backend=cuda --socket="$sock" --log-level=info >"$out/kvd-connectors.log" 2>&1 &
daemon=$!
for _ in $(seq 300); do [[ -S $dir/gpu0.handles ]] && break; sleep 0.1; done
run caps kvctl --socket="$sock" caps
run caps_json kvctl --socket="$sock" --json caps
grep -q '"HANDLE_TYPE_DMA_BUF"' "$out/caps_json.log" || { echo "!!! DMA_BUF not advertised"; status=1; }
# wait_for FILE PATTERN [COUNT]: until FILE has COUNT lines matching PATTERN (2 min), or the peer said error.
wait_for() {
  for _ in $(seq 1200); do
    (($(grep -c -- "$2" "$1") >= ${3:-1})) && return 0
    grep -q '^error' "$1" && { grep '^error' "$1"; return 1; }
    sleep 0.1
  done
  echo "!!! timed out waiting for $2 in $1"
  return 1
}
# check_dmabufs FILE FIRST_LINE: every dmabuf line from FIRST_LINE on has fdinfo size == bytes and
# exp_name nv_dmabuf; prints the count and bytes.
check_dmabufs() {
  tail -n "+$2" "$1" | awk '$1 == "dmabuf" { n++; bytes += $4; if ($6 != $4 || $7 != "nv_dmabuf") { bad++; print "!!! " $0 } }
    END { printf "%d DMA-BUF FDs, %.2f GiB, %d with a wrong size or exporter\n", n, bytes / 2^30, bad; exit (bad > 0 || n == 0) }'
}
# Llama-70B-like: 80 layers, 5 MiB blocks, created at half the size and grown to all of it, so every
# segment has two chunks or more. LBNHC: 80 segments, one FD each spanning its chunks; BLNHC: one segment
# of 4 GiB chunks, one FD spanning them all.
dims=(--layers=80 --capacity-blocks=32768 --heads=16 --block-tokens=16 --channels=128 --element-bytes=2)
blocks=$(python3 -c 'import re,sys; n,u=re.fullmatch(r"(\d+)([KMGT]i)?B?",sys.argv[1]).groups(); print(int(n)*{None:1,"Ki":2**10,"Mi":2**20,"Gi":2**30,"Ti":2**40}[u]//(5*2**20))' "$pool_size")
for layout in LBNHC BLNHC; do
  pool=kv-$layout
  run "create_$layout" kvctl --socket="$sock" create "$pool" "${dims[@]}" --layout="$layout" --initial-blocks=$((blocks / 2))
  run "grow_$layout" kvctl --socket="$sock" grow "$pool" --blocks="$blocks"
  # Chunk.fabric_handle is filled exactly where FABRIC is advertised (the probe export worked).
  kvctl --socket="$sock" --json describe "$pool" | python3 -c 'import json, sys
p = json.load(sys.stdin); fab = sys.argv[1] != "0"
bad = [c["id"] for c in p["chunks"] if bool(c.get("fabric_handle")) != fab]
print(len(p["chunks"]), "chunks; fabric handles", "expected" if fab else "absent", "; wrong:", bad); sys.exit(1 if bad else 0)' \
    "$(grep -c '"HANDLE_TYPE_FABRIC"' "$out/caps_json.log")" || status=1
  run "transfer_$layout" kvctl --socket="$sock" transfer "$pool" --blocks="0-$((blocks / 8)),$((blocks / 4))-$((blocks / 2)),$((blocks - 1))"
  fifo=$dir/peer-$layout.in
  mkfifo "$fifo"
  log=$out/peer-$layout.log
  connector_peer --fdinfo "$sock" "$pool" <"$fifo" >"$log" 2>&1 &
  peer=$!
  exec {w}>"$fifo"
  step "$layout: the connector process exports every committed range"
  wait_for "$log" '^exported' || status=1
  grep '^exported' "$log"
  check_dmabufs "$log" 1 || status=1
  step "$layout: shrink to half with --wait (releases the grown chunks): the connector deregisters first"
  kvctl --socket="$sock" shrink "$pool" --blocks=$((blocks / 2)) --wait || status=1
  wait_for "$log" '^deregistered' || status=1
  grep -c '^released' "$log"
  step "$layout: grow back: the connector exports only the new ranges"
  kvctl --socket="$sock" grow "$pool" --blocks="$blocks" || status=1
  wait_for "$log" '^added' || status=1
  sleep 1  # every added line of the event
  first=$(($(wc -l <"$log") + 1))
  echo export-added >&"$w"
  wait_for "$log" '^exported' 2 || status=1
  grep '^exported' "$log" | tail -n 1
  check_dmabufs "$log" "$first" || status=1
  echo quit >&"$w"
  exec {w}>&-
  wait "$peer" || { echo "!!! connector_peer exited $?"; status=1; }
  kvctl --socket="$sock" delete "$pool" >/dev/null || status=1
done
kill -TERM "$daemon"
wait "$daemon"
echo "kvd exited $?"
rm -rf "$dir"
}

# -- one step, in its own session: run_gpu.sh re-runs itself with RUN_GPU_STEP set ----------------------
if [[ -n ${RUN_GPU_STEP:-} ]]; then
  "step_$RUN_GPU_STEP"
  exit $status
fi

# -- the driver ----------------------------------------------------------------------------------------
self=$(readlink -f "${BASH_SOURCE[0]}")
all_steps=(device daemon durable restart reshape release group python bench connectors engines arbitrate keep node)
default_steps="device daemon durable restart reshape release group python connectors"
needs_python=" restart reshape release python engines arbitrate keep node "
# Wall-clock limits (s): each a few times what the step took at the defaults on an H200 (docs/gpu.md).
declare -A limit=([device]=150 [daemon]=60 [durable]=90 [restart]=200 [reshape]=300 [release]=240 [group]=90
                  [python]=180 [bench]=540 [connectors]=90 [engines]=300 [arbitrate]=150 [keep]=240
                  [node]=300)
run_budget=${RUN_BUDGET_S:-560}
run_started=$(date +%s)
export KVD_GPU_RUN="$run_started-$$"  # every process this run starts inherits it
want() { [[ " ${STEPS:-$default_steps} " == *" $1 "* ]]; }

used_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -d ' '; }
driver_sid=$(ps -o sid= -p $$ | tr -d ' ')
ours() {  # the live processes of this run: in session $1 (if given), or marked and outside this shell's session
  # (each step and the watchdog run in sessions of their own; what is in this one is this shell's helpers)
  local p sid
  { [[ -n ${1:-} ]] && ps -o pid= -s "$1" 2>/dev/null
    grep -lsz "^KVD_GPU_RUN=$KVD_GPU_RUN\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
  } | tr -d ' ' | sort -un | while read -r p; do
    sid=$(ps -o sid= -p "$p" 2>/dev/null | tr -d ' ')
    [[ -n $sid && $sid != "$driver_sid" ]] && echo "$p"
  done
}
describe() {
  local cmd
  cmd=$({ tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null | cut -c1-160)
  printf 'pid %s (%s)' "$1" "${cmd:-exited, or not visible here}"
}
stop_ours() {  # stop_ours [SID]: SIGTERM what is left of this run, SIGKILL after 10 s; says what it stopped
  local pids p
  mapfile -t pids < <(ours "${1:-}")
  ((${#pids[@]})) || return 0
  for p in "${pids[@]}"; do echo "--- stopping $(describe "$p")"; done
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 100); do
    mapfile -t pids < <(ours "${1:-}")
    ((${#pids[@]})) || return 0
    sleep 0.1
  done
  for p in "${pids[@]}"; do echo "--- killing $(describe "$p") (still there 10 s after SIGTERM)"; done
  kill -KILL "${pids[@]}" 2>/dev/null
  for _ in $(seq 50); do
    mapfile -t pids < <(ours "${1:-}")
    ((${#pids[@]})) || return 0
    sleep 0.1
  done
  echo "!!! still running after SIGKILL: ${pids[*]}"
}
holders() {  # what holds GPU memory, each marked when it is this run's
  local pid mem
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
    while IFS=', ' read -r pid mem; do
      [[ -n $pid ]] || continue
      printf '  %s MiB: %s%s\n' "$mem" "$(describe "$pid")" \
        "$(grep -qsz "^KVD_GPU_RUN=$KVD_GPU_RUN\$" "/proc/$pid/environ" && echo ' -- started by this run')"
    done
}
settle() {  # until the GPU is back at the run's baseline (20 s); else name the holders, stop ours, 20 s more
  local used
  for _ in $(seq 40); do
    used=$(used_mib)
    ((${used:-0} <= baseline + ${GPU_SLACK_MIB:-1024})) && return 0
    sleep 0.5
  done
  echo "!!! before $1: the GPU uses $used MiB, $((used - baseline)) MiB above the run's start; held by:"
  holders
  stop_ours
  for _ in $(seq 40); do
    used=$(used_mib)
    ((${used:-0} <= baseline + ${GPU_SLACK_MIB:-1024})) && { echo "--- back at $used MiB"; return 0; }
    sleep 0.5
  done
  echo "!!! still $used MiB used: $1 runs with less memory than it expects; held by:"
  holders
  return 1
}
run_step() {  # run_step NAME: the step in a session of its own, under its limit, then everything it left stopped
  local name=$1 now started lim sid rc watchdog
  now=$(date +%s)
  lim=${STEP_LIMIT_S:-${limit[$name]}}
  if ((now + lim > run_started + run_budget)); then
    lim=$((run_started + run_budget - now))
    if ((lim < 30)); then
      echo "!!! $name not run: the run's budget (RUN_BUDGET_S=$run_budget s) is spent"
      results+=("$name NOT-RUN")
      status=1
      return
    fi
  fi
  settle "$name" || status=1
  started=$(date +%s)
  RUN_GPU_STEP=$name RUN_GPU_DEADLINE=$((started + lim)) setsid bash "$self" "$bundle" "$pool_size" </dev/null &
  sid=$!
  # The watchdog, in a session of its own too, so that stopping it stops its sleep.
  # shellcheck disable=SC2016  # expanded by the watchdog's shell
  setsid bash -c 'sleep "$1"; echo "!!! $3: past its limit of $1 s: stopping it"; kill -TERM -- "-$2" 2>/dev/null
    sleep 10; kill -KILL -- "-$2" 2>/dev/null' watchdog "$lim" "$sid" "$name" &
  watchdog=$!
  wait "$sid"
  rc=$?
  kill -- "-$watchdog" 2>/dev/null
  wait "$watchdog" 2>/dev/null
  stop_ours "$sid"
  local took=$(($(date +%s) - started)) verdict=PASSED
  ((rc == 0)) || { verdict="FAILED (rc $rc)"; status=1; }
  echo "=== $name: $verdict in $took s; GPU $(used_mib) MiB used"
  results+=("$name $verdict ${took}s")
}

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
baseline=$(used_mib)
baseline=${baseline:-0}
echo "run $KVD_GPU_RUN: GPU at $baseline MiB to begin with; steps: ${STEPS:-$default_steps}"
[[ $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) ]] && { echo "!!! GPU memory held before the run:"; holders; }
results=()
for s in "${all_steps[@]}"; do
  want "$s" || continue
  if [[ $needs_python == *" $s "* && ! -d $bundle/python ]]; then
    echo "!!! $s not run: the bundle has no python/ (build the kvd_python target before bundling)"
    results+=("$s NOT-RUN")
    status=1
    continue
  fi
  run_step "$s"
done
stop_ours
step "gpu run: $([[ $status == 0 ]] && echo PASSED || echo FAILED) in $(($(date +%s) - run_started)) s"
printf '  %s\n' "${results[@]}"
exit $status
