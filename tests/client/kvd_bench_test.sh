#!/usr/bin/env bash
# kvd_bench against a real kvd on the host backend (it starts its own): it runs, prints its table, and its
# --json has every section and every line, each with non-negative numbers or a reason it was skipped.
# A smoke test: no time is checked. Usage: kvd_bench_test.sh KVD KVD_BENCH
set -euo pipefail
kvd=$1 bench=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# A failing step says which it was and shows what the bench printed (its stderr goes to files below).
failed() {
  echo "kvd_bench_test: line $1 failed: $2" >&2
  for f in "$dir"/*.txt "$dir"/err; do [[ -s $f ]] && { echo "--- the end of ${f##*/}:"; tail -n 40 "$f"; }; done >&2
}
trap 'failed $LINENO "$BASH_COMMAND"' ERR
"$bench" --help >"$dir/help"  # not into grep -q: it would close the pipe before the help is written (pipefail)
grep -q -- "--bytes" "$dir/help"
grep -q -- "--chunk-sweep" "$dir/help"
"$bench" --kvd="$kvd" --backend=host --bytes=128MiB --segments=8 --reps=3 --fragments=4 --compact-grows=4 --compact-chunks-per-pause=8 --rpc-calls=200 --watch-streams=16 \
  --bookkeeping-bytes=256MiB --bookkeeping-pools=16 --json >"$dir/out.json" 2>"$dir/table.txt"
cat "$dir/table.txt"
for line in grow attach grow_mapped sleep wake wake_mapped shrink fragmented_grow fragmented_attach compact compact_pause compact_attach \
  shrink_to_half control_rpc concurrent_resize_grow concurrent_resize_shrink concurrent_raw_grow concurrent_raw_shrink \
  granule_design torch_zeros reclaim saturate; do
  grep -q "^$line " "$dir/table.txt" || { echo "no $line row in the table"; exit 1; }
done
for line in grow attach grow_mapped sleep wake wake_mapped shrink; do
  for variant in after_release after_pause; do
    grep -q "^  $line $variant in-process, kvd/in-process p50: single (1 allocation) p50 .*; per_segment (8 allocations) p50 " \
      "$dir/table.txt" || { echo "no in-process row under $line $variant"; exit 1; }
  done
done
python3 - "$dir/out.json" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
assert d["program"] == "kvd_bench" and d["device"]["backend"] == "host", d["device"]
for key in ("bytes", "segments", "chunks", "reps", "pause_ms", "compact_grows", "compact_bytes", "shrink_bytes"):
    assert d["config"][key] >= 0, key
assert d["config"]["raw_release_first"] == "importer", d["config"]
want = {("grow", v) for v in ("after_release", "after_pause")}
lifecycle = ("grow", "attach", "grow_mapped", "sleep", "wake", "wake_mapped", "shrink")
want |= {(op, v) for op in lifecycle for v in ("after_release", "after_pause")}
want |= {("fragmented_grow", "after_pause"), ("fragmented_attach", "after_pause"),
         ("compact", "4_grows"), ("compact_pause", "4_grows"), ("compact_attach", "before_compact"),
         ("compact_attach", "after_compact"), ("shrink_to_half", "once_grown"),
         ("control_rpc", "idle"), ("control_rpc", "during_grow"), ("control_rpc", "watch_streams"),
         ("control_rpc", "idle_client"), ("control_rpc", "idle_daemon"), ("control_rpc", "idle_reply"),
         ("control_rpc", "idle_server"), ("control_rpc", "callback_threads"),
         ("concurrent_resize_grow", "4_pools"), ("concurrent_resize_shrink", "4_pools"),
         ("concurrent_raw_grow", "4_pools"), ("concurrent_raw_shrink", "4_pools"),
         ("granule_design", "after_pause"), ("torch_zeros", "after_pause"),
         ("reclaim", "a_holds_the_device"), ("saturate", "8_engines"),
         ("sleep_keep", "whole_pool"), ("wake_keep", "whole_pool")}
got = {(l["name"], l["variant"]): l for l in d["lines"]}
missing = want - set(got)
assert not missing, f"missing lines: {sorted(missing)}"
# Host: torch is CUDA only; everything else runs.
# reclaim and saturate need a small budget (the run below): here they say why not.
# The keep lines need --keep-bytes (a host tier): the run at the end.
must_skip = {("torch_zeros", "after_pause"), ("reclaim", "a_holds_the_device"), ("saturate", "8_engines"),
             ("sleep_keep", "whole_pool"), ("wake_keep", "whole_pool")}
for key, l in got.items():
    if key in must_skip:
        assert l.get("skipped"), f"{key} must say why it was skipped"
        continue
    assert "skipped" not in l, f"{key} skipped: {l['skipped']}"
    for side in ("kvd", "baseline"):
        s = l[side]
        assert s["n"] >= 3 and len(s["samples_ms"]) == s["n"], (key, side, s)
        for v in [s["p50_ms"], s["p99_ms"]] + s["samples_ms"]:
            assert v is not None and v >= 0 and math.isfinite(v), (key, side, v)
    assert l["ratio"] is not None and l["ratio"] >= 0, (key, l["ratio"])
# Every lifecycle line has both in-process peers, one sample per repetition, with a ratio; the issue-25
# target (<= 1.2 of one allocation per segment, for a layer-outermost pool) on giving, releasing and taking
# back the memory.
assert d["config"]["reps"] == 3 and d["config"]["lifecycle_reps"] == 3 and d["config"]["deadline_s"] == 0, d["config"]
for op in lifecycle:
    for v in ("after_release", "after_pause"):
        l = got[(op, v)]
        peers = l["in_process"]
        assert set(peers) == {"single", "per_segment"}, (op, v, peers.keys())
        assert peers["single"]["allocations"] == 1 and peers["per_segment"]["allocations"] == d["config"]["segments"], peers
        for name, p in peers.items():
            assert p["n"] == l["kvd"]["n"] == 3 and len(p["samples_ms"]) == p["n"], (op, v, name, p)
            for x in [p["p50_ms"], p["p99_ms"], p["ratio"]] + p["samples_ms"]:
                assert x is not None and x >= 0 and math.isfinite(x), (op, v, name, x)
            assert p["what"].startswith("in this process"), p["what"]
            want_target = "<= 1.2" if name == "per_segment" and op in ("grow_mapped", "sleep", "wake_mapped") else ""
            assert p["target"] == want_target, (op, v, name, p["target"])
for key, l in got.items():
    assert ("in_process" in l) == (key[0] in lifecycle), key
# attach and sleep carry a per-phase breakdown on both sides, one sample per repetition.
for op in ("attach", "sleep"):
    for v in ("after_release", "after_pause"):
        ph = got[(op, v)]["phases"]
        for side in ("kvd", "baseline"):
            assert ph[side], (op, v, side)
            for name, s in ph[side].items():
                assert s["n"] == got[(op, v)][side]["n"], (op, v, side, name)
                assert all(x is not None and x >= 0 for x in s["samples_ms"]), (op, v, side, name, s)
# The reshape lines: both sides' phases, one sample per repetition, and the pool they ran on.
assert d["config"]["compact_grows"] == 4 and d["config"]["compact_chunks_per_pause"] == 8 and d["config"]["compact_bytes"] > 0 and d["config"]["shrink_bytes"] > 0, d["config"]
for key in (("compact", "4_grows"), ("shrink_to_half", "once_grown")):
    ph = got[key]["phases"]
    want = {"call", "pause", "copy", "free_wait"} | ({"longest_pause"} if key[0] == "compact" else set())
    assert set(ph["kvd"]) == want, (key, ph["kvd"].keys())
    assert set(ph["baseline"]) == {"create_map", "copy", "release_old", "remap", "free_wait"}, (key, ph["baseline"].keys())
    for side in ("kvd", "baseline"):
        for name, s in ph[side].items():
            assert s["n"] == got[key][side]["n"], (key, side, name)
            assert all(x is not None and x >= 0 for x in s["samples_ms"]), (key, side, name, s)
    assert "pattern samples" in got[key]["note"], (key, got[key]["note"])
# 8 segments of 4 chunks, at most 8 replaced a pause: two new chunks a step, each step paused the client.
assert "32 -> 8 chunks in 4 steps" in got[("compact", "4_grows")]["note"], got[("compact", "4_grows")]["note"]
assert got[("compact_attach", "after_compact")]["target"] == "<= 1.5"
assert got[("shrink_to_half", "once_grown")]["target"] == "<= 1.2"
b = d["bookkeeping"]
assert "skipped" not in b, b
assert b["chunks"] > 0 and b["pools"] == 16, b
for key in ("daemon_bytes_per_chunk", "raw_bytes_per_chunk", "daemon_own_bytes_per_chunk", "daemon_bytes_per_pool",
            "fds_per_chunk",
            "fds_per_chunk_after_attach"):
    assert b[key] is not None and math.isfinite(b[key]), (key, b[key])
assert b["fds_per_chunk"] >= 0, b
assert isinstance(b["exports_per_chunk"], dict) or b["exports_per_chunk"] > 0, b
# The idle line counts the daemon's and the bare server's context switches per call and the daemon's callback
# threads; callback_threads counts the
# second process's before and after its callback server started.
# kvd serves no method on gRPC's callback API (Note [No callback API] in docs/architecture.md): none of its threads;
# gRPC runs at least two in a process that serves a callback method, as the second process does once its callback
# server started.
import re
m = re.fullmatch(r"voluntary context switches per call: the daemon ([0-9.]+), the bare server's process ([0-9.]+); "
                 r"([0-9]+) of gRPC's callback threads \(nexting_thread\) in the daemon",
                 got[("control_rpc", "idle")]["note"])
assert m and float(m[1]) > 0 and float(m[2]) > 0 and int(m[3]) == 0, got[("control_rpc", "idle")]["note"]
m = re.fullmatch(r"the second process's gRPC callback threads \(nexting_thread\): ([0-9]+) -> ([0-9]+)",
                 got[("control_rpc", "callback_threads")]["note"])
assert m and int(m[2]) >= 2, got[("control_rpc", "callback_threads")]["note"]
print("kvd_bench JSON: %d lines, bookkeeping complete" % len(got))
PY
# A bad size is refused with the flag's name.
if "$bench" --kvd="$kvd" --backend=host --bytes=4MiB 2>"$dir/err"; then echo "4MiB over 8 segments must fail"; exit 1; fi
grep -q -- "--bytes" "$dir/err"
if "$bench" --kvd="$kvd" --backend=host --bytes=128MiB --compact-grows=5 2>"$dir/err"; then
  echo "5 grows of 64MiB over 8 segments must fail"; exit 1
fi
grep -q -- "--compact-grows" "$dir/err"
# --sections runs only the parts named: here the exact shrink, whose line is then the only one.
"$bench" --kvd="$kvd" --backend=host --bytes=128MiB --reps=1 --sections=shrink_to_half --json >"$dir/one.json" \
  2>"$dir/one.txt"
python3 - "$dir/one.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["config"]["sections"] == "shrink_to_half", d["config"]
assert [(l["name"], l["variant"]) for l in d["lines"]] == [("shrink_to_half", "once_grown")], d["lines"]
assert "skipped" not in d["lines"][0] and d["lines"][0]["kvd"]["n"] == 1, d["lines"][0]
assert d["bookkeeping"] == {"skipped": "not in --sections"}, d["bookkeeping"]
PY
# The arbitration lines on a budget they can fill (384 MiB): B's grow is served by a reclaim of A, whose
# live samples are checked by the bench itself, and the 8 engines meet no driver out-of-memory error.
"$bench" --kvd="$kvd" --backend=host --bytes=128MiB --segments=2 --budget=384MiB --reps=2 --sections=reclaim,saturate --json \
  >"$dir/arb.json" 2>"$dir/arb.txt"
python3 - "$dir/arb.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
got = {(l["name"], l["variant"]): l for l in d["lines"]}
r, s = got[("reclaim", "a_holds_the_device")], got[("saturate", "8_engines")]
assert "skipped" not in r and r["kvd"]["n"] == 2 and r["baseline"]["n"] == 2, r
assert list(r["phases"]["kvd"]) == ["to_ask", "give_to_reply"], r["phases"]
assert "skipped" not in s and s["ratio"] == 0, s
PY
# A block-outermost pool: one segment, so one in-process peer (one allocation), which carries the target; raw
# releases in kvd's order.
"$bench" --kvd="$kvd" --backend=host --bytes=64MiB --chunk=16MiB --reps=1 --layout=BLHNC --sections=lifecycle \
  --raw-release-first=exporter --json \
  >"$dir/blhnc.json" 2>"$dir/blhnc.txt"
python3 - "$dir/blhnc.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d["config"]
assert c["layout"] == "BLHNC" and c["segments"] == 1 and c["layers"] == 8 and c["chunks"] == 4, c
assert c["raw_release_first"] == "exporter", c
for l in d["lines"]:
    peers = l["in_process"]
    assert list(peers) == ["single"] and peers["single"]["allocations"] == 1 and peers["single"]["n"] == 1, (l["name"], peers)
    want = "<= 1.2" if l["name"] in ("grow_mapped", "sleep", "wake_mapped") else ""
    assert peers["single"]["target"] == want, (l["name"], peers["single"]["target"])
PY
if "$bench" --kvd="$kvd" --backend=host --bytes=128MiB --layout=BLHNC --sections=lifecycle,compact 2>"$dir/err"; then
  echo "--layout=BLHNC with compact must fail"; exit 1
fi
grep -q -- "--layout: BLHNC measures the lifecycle" "$dir/err"
# --deadline-s stops the lifecycle's repetitions (the first always runs) and says how many ran.
"$bench" --kvd="$kvd" --backend=host --bytes=64MiB --reps=200 --deadline-s=1 --sections=lifecycle --json \
  >"$dir/deadline.json" 2>"$dir/deadline.txt"
python3 - "$dir/deadline.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
n = d["config"]["lifecycle_reps"]
assert d["config"]["reps"] == 200 and 1 <= n < 200, d["config"]
assert all(l["kvd"]["n"] == n and l["baseline"]["n"] == n for l in d["lines"]), [(l["name"], l["kvd"]["n"]) for l in d["lines"]]
PY
grep -q "^lifecycle: [0-9]* of 200 repetitions ran (--deadline-s 1)" "$dir/deadline.txt"
# The chunk sweep: every size, both variants, every phase and sum, per GiB and per handle; the scrub; the
# fastest size of each sum is one of the sizes.
"$bench" --backend=host --chunk-sweep --sweep-bytes=64MiB --sweep-sizes=2MiB,8MiB,32MiB --sweep-reps=2 --json \
  >"$dir/sweep.json" 2>"$dir/sweep.txt"
cat "$dir/sweep.txt"
for size in "2.00 MiB  *32" "8.00 MiB  *8" "32.0 MiB  *2"; do
  for variant in after_release after_pause scrub; do
    [[ $(grep -c "^$size $variant " "$dir/sweep.txt") == 2 ]] || { echo "no $size $variant rows in both sweep tables"; exit 1; }
  done
done
grep -q "^fastest per GiB, after_pause: grow .*, attach .*, release_all .*, total " "$dir/sweep.txt"
python3 - "$dir/sweep.json" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
assert d["program"] == "kvd_bench" and d["mode"] == "chunk_sweep" and d["device"]["backend"] == "host", d["device"]
c = d["config"]
sizes = [2 << 20, 8 << 20, 32 << 20]
assert c["bytes"] == 64 << 20 and c["reps"] == 2 and c["chunk_sizes"] == sizes, c
assert [s["chunk_bytes"] for s in d["sizes"]] == sizes, d["sizes"]
phases = {"create", "map", "export", "import", "import_map", "import_release", "release", "free_wait"}
sums = {"grow", "attach", "release_all", "total"}
finite = lambda x: x is not None and math.isfinite(x)
for s in d["sizes"]:
    assert "skipped" not in s and s["handles"] == c["bytes"] // s["chunk_bytes"], s
    for v in ("after_release", "after_pause"):
        assert set(s[v]) == phases | sums, (s["chunk_bytes"], v, s[v].keys())
        for name, p in s[v].items():
            assert p["n"] == 2 and len(p["samples_ms"]) == 2, (s["chunk_bytes"], v, name, p)
            for x in p["samples_ms"] + [p["p50_ms"], p["p99_ms"], p["per_gib_ms"], p["per_handle_us"]]:
                assert finite(x) and x >= 0, (s["chunk_bytes"], v, name, x)
        total = sum(s[v][p]["samples_ms"][0] for p in phases)
        assert abs(total - s[v]["total"]["samples_ms"][0]) < 1e-3 * max(1, total), (s["chunk_bytes"], v, total)
    assert all(finite(s["scrub"][k]) for k in ("ms", "per_gib_ms", "per_handle_us")), s["scrub"]
for v in ("after_release", "after_pause"):
    assert set(d["fastest"][v]) == sums and all(x in sizes for x in d["fastest"][v].values()), d["fastest"]
print("kvd_bench chunk sweep JSON: %d sizes complete" % len(d["sizes"]))
PY
if "$bench" --backend=host --chunk-sweep --sweep-bytes=64MiB --sweep-sizes=2MiB,3MiB 2>"$dir/err"; then
  echo "a chunk size off the granularity must fail"; exit 1
fi
grep -q -- "--sweep-sizes: 3.00 MiB is not a multiple of the granularity" "$dir/err"
if "$bench" --kvd="$kvd" --backend=host --bytes=128MiB --sections=lifecycle,nope 2>"$dir/err"; then
  echo "an unknown section must fail"; exit 1
fi
grep -q -- '--sections: unknown section "nope"' "$dir/err"
echo "kvd_bench_test: 1 passed, 0 failed"
# The keep lines with a host tier: a sleep that keeps 64 MiB and the wake that copies them back, against the
# same copies to registered memory in-process, each with its repetitions, a ratio and a copy rate.
"$bench" --kvd="$kvd" --backend=host --bytes=128MiB --segments=8 --reps=3 --sections=keep --keep-bytes=64MiB --json \
  >"$dir/keep.json" 2>"$dir/keep.txt"
grep -q "keep: the host tier was ready" "$dir/keep.txt"  # measured after the tier's background preparation
python3 - "$dir/keep.json" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
got = {(l["name"], l["variant"]): l for l in d["lines"]}
assert set(got) == {("sleep_keep", "whole_pool"), ("wake_keep", "whole_pool")}, sorted(got)
for key, l in got.items():
    assert "skipped" not in l, (key, l["skipped"])
    assert l["target"] == "<= 1.10", (key, l["target"])
    for side in ("kvd", "baseline"):
        assert l[side]["n"] == 3 and all(v >= 0 and math.isfinite(v) for v in l[side]["samples_ms"]), (key, side)
    assert l["ratio"] > 0 and "GB/s" in l["note"], (key, l)
assert "8 chunks" in got[("sleep_keep", "whole_pool")]["kvd_what"], got[("sleep_keep", "whole_pool")]
PY
if "$bench" --kvd="$kvd" --backend=host --bytes=128MiB --sections=keep --keep-bytes=1MiB 2>"$dir/err"; then
  echo "1MiB over 8 segments must fail"; exit 1
fi
grep -q -- "--keep-bytes" "$dir/err"
