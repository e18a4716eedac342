"""The GPU run's engines step, part 2: a transformers Llama (random weights from a config, float32, SDPA) generating
through kvd.transformers.KvdCache, token- and logit-identical to transformers' own DynamicCache through a grow, five
small grows by another session, a compaction while it decodes, a SIGKILL of kvd while it decodes, a SIGKILL of the
engine (a new process adopts the checkpoint and decodes on without a prefill) and a sleep that keeps the cached tokens
in kvd's host tier (the woken cache decodes on without a prefill). Skips, saying so, where transformers is not installed.

    python3 engines_transformers.py BIN_DIR OUT_DIR        (KVD_SOCKET_DIR unused: it starts its own kvd)
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SEGMENT = 8          # new tokens per generate() call
PROMPT = 8200        # past one 2 MiB granule of a segment (8192 tokens of 64 float32 channels): the prefill grows
POOL = "engines-llama"


def skip_without_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED engines_transformers: transformers is not installed here ({e}); nothing was checked")
        sys.exit(0)


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=65536,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.float32).eval()


def prompt_ids():
    import torch
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 1000, (1, PROMPT), generator=g)


def generate(model, ids, cache, n):
    import torch
    ids = ids.cuda()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_logits=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    return out.sequences.cpu(), new, [l[0].float().cpu() for l in out.logits]


def engine(socket, phase, state_path):
    """A child engine process. phase "a": fresh cache, segments driven by the parent over stdin/stdout; phase "b":
    adopt the checkpoint, decode on, sleep/wake, decode again."""
    import torch
    import kvd
    import kvd.transformers
    model = build_model()
    client = kvd.connect(socket)
    cache = kvd.transformers.KvdCache(model, POOL, client=client, max_cache_len=65536, block_tokens=16,
                                      initial_tokens=16)
    results = []
    if phase == "b":  # engine a's segments, then b's own
        with open(state_path) as f:
            results = json.load(f)

    def while_kvd_restarts(call):
        for attempt in range(300):  # kvd may be restarting (the parent kills it during a segment)
            try:
                return call()
            except kvd.KvdError as e:
                if e.code != "UNAVAILABLE" or attempt == 299:
                    raise
                time.sleep(0.1)

    def run(ids, what):
        before = cache.get_seq_length()
        seq, new, logits = generate(model, ids, cache, SEGMENT)
        while_kvd_restarts(lambda: cache.checkpoint(seq[0].tolist()))
        results.append({"what": what, "tokens": new, "cache_before": before, "input": ids.shape[1],
                        "logits": [l.tolist() for l in logits]})
        with open(state_path, "w") as f:
            json.dump(results, f)
        return seq

    if phase == "a":
        ids = prompt_ids()
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "exit":
                break
            ids = run(ids, cmd)
            chunks = while_kvd_restarts(lambda: len(client.pool(POOL).chunks))
            print("done", cmd, cache.get_seq_length(), chunks, flush=True)
        time.sleep(600)  # killed here
    else:
        assert cache.store.adopted, "the new engine did not adopt the pool"
        ids = torch.tensor([cache.tokens])
        assert cache.get_seq_length() == ids.shape[1] - 1, (cache.get_seq_length(), ids.shape)
        ids = run(ids, "adopted")  # only the last token is new to the cache: no prefill
        kept = cache.get_seq_length()
        cache.sleep(keep=True)     # the cached tokens' blocks go to kvd's host tier
        cache.wake()
        assert cache.get_seq_length() == kept and cache.store.emptied == 0, (cache.get_seq_length(), kept)
        run(ids, "after-wake")     # decodes on: no prefill
        cache.close(delete=True)
        print("done b", flush=True)


def main():
    skip_without_transformers()
    import torch
    import kvd
    bin_dir, out = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="kvd-engines-")
    os.chmod(tmp, 0o750)
    socket = os.path.join(tmp, "gpu0.sock")
    argv = [os.path.join(bin_dir, "kvd"), "--backend=cuda", "--socket=" + socket, "--budget=8GiB",
            "--host-tier-bytes=2GiB"]
    log = open(os.path.join(out, "kvd-engines.log"), "ab")

    def start():
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        for _ in range(300):
            if os.path.exists(socket.replace(".sock", ".handles")):
                break
            time.sleep(0.1)
        return p

    daemon = start()
    try:
        model = build_model()
        ids = prompt_ids()
        t0 = time.monotonic()
        _, ref_tokens, ref_logits = generate(model, ids, None, 6 * SEGMENT)  # DynamicCache, one go
        print(f"reference: {len(ref_tokens)} tokens after a {PROMPT}-token prompt with DynamicCache in "
              f"{time.monotonic() - t0:.2f} s")
        del model
        torch.cuda.empty_cache()

        state = os.path.join(out, "engines_transformers_state.json")
        here = os.path.abspath(__file__)
        a = subprocess.Popen([sys.executable, here, "--engine", socket, "a", state], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

        def seg(cmd):
            a.stdin.write(cmd + "\n")
            a.stdin.flush()
            line = a.stdout.readline().strip()
            assert line.startswith("done " + cmd), f"engine a: {line!r}"
            print("engine a:", line)

        operator = kvd.connect(socket)
        seg("prefill-grow")                       # 8200 tokens: grows past the first granule
        g = operator.pool(POOL)
        per_block = g.geometry.block_stride
        for i in range(5):                        # five small grows by another session: the cache's Mapping follows
            operator.grow(POOL, operator.pool(POOL).committed_blocks + (2 << 20) // per_block)
        print("five grows:", len(operator.pool(POOL).chunks), "chunks")
        seg("after-grows")
        a.stdin.write("during-compact\n")
        a.stdin.flush()
        reply = operator.compact(POOL)            # while the engine decodes: it pauses between forwards
        line = a.stdout.readline().strip()
        print("engine a:", line, "| compact:", reply.reshape.chunks_before, "->", reply.reshape.chunks_after,
              "chunks, steps", reply.reshape.steps, "max pause", reply.reshape.max_pause_us, "us")
        a.stdin.write("during-kvd-kill\n")
        a.stdin.flush()
        time.sleep(0.05)
        daemon.send_signal(signal.SIGKILL)        # while it decodes; its Mapping rides through
        daemon.wait()
        t_kill = time.monotonic()
        daemon = start()
        line = a.stdout.readline().strip()
        print("engine a:", line, f"| kvd SIGKILLed and back in {time.monotonic() - t_kill:.2f} s")
        operator.close()
        # kvd has no FD store here (DURABILITY_CLIENTS): the pool is RECOVERING until engine a's Mapping hands
        # its chunks back. Killing the engine before that would lose them (the recovery grace then sleeps the
        # pool), so wait for the hand-back, as a supervisor would before restarting an engine on purpose.
        operator = kvd.connect(socket)
        while operator.pool(POOL).state == kvd.v1_pb2.POOL_STATE_RECOVERING:
            assert time.monotonic() - t_kill < 30, f"engine a gave no chunks back: {operator.pool(POOL)}"
            time.sleep(0.05)
        print(f"engine a's chunks handed back to the new kvd {time.monotonic() - t_kill:.2f} s after the kill")
        operator.close()
        a.send_signal(signal.SIGKILL)             # the engine dies; the pool and its checkpoint stay
        a.wait()

        b = subprocess.run([sys.executable, here, "--engine", socket, "b", state], capture_output=True, text=True,
                           timeout=300)
        print("engine b:", b.stdout.strip(), b.stderr.strip()[-2000:])
        assert b.returncode == 0, f"engine b exited {b.returncode}"

        with open(state) as f:
            results = json.load(f)
        got_tokens = [t for r in results for t in r["tokens"]]
        worst = 0.0
        for i, r in enumerate(results):
            for j, l in enumerate(r["logits"]):
                d = (torch.tensor(l) - ref_logits[i * SEGMENT + j]).abs().max().item()
                worst = max(worst, d)
            print(f"  {r['what']:16} cache had {r['cache_before']:5} of {r['input']:5} input tokens; tokens "
                  f"{'==' if r['tokens'] == ref_tokens[i * SEGMENT:(i + 1) * SEGMENT] else '!='} DynamicCache's")
        assert [r["what"] for r in results] == ["prefill-grow", "after-grows", "during-compact", "during-kvd-kill",
                                                "adopted", "after-wake"], [r["what"] for r in results]
        assert results[4]["cache_before"] == results[4]["input"] - 1, "the adopted engine prefilled"
        assert results[5]["cache_before"] == results[5]["input"] - 1, "the woken cache did not keep its tokens"
        assert got_tokens == ref_tokens, f"tokens differ:\n kvd {got_tokens}\n ref {ref_tokens}"
        print(f"PASS engines_transformers: {len(got_tokens)} tokens identical to DynamicCache's; largest logit "
              f"difference {worst:.3g}")
        assert worst <= 1e-3, f"logits differ by {worst}"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(*sys.argv[2:5])
    else:
        main()
