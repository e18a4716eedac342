"""restart_peer.py: an engine in its own process using the Python package, for restart_test.py; the
counterpart of tests/client/restart_peer.cc with the same pattern and the same line protocol.

It attaches POOL at SOCKET, writes the layers l with l % 2 == PARITY (every byte of every committed
block: byte k of element row (b, h, n), i = ((b*H + h)*N + n)*C*e + k, is (7*i + 13*l + 29*b) % 251 + 1),
keeps rewriting them on a thread while kvd restarts, and checks every layer on `check`.
Usage: restart_peer.py SOCKET POOL PARITY
"""
import sys
import threading

import numpy

import kvd


def say(line):
    print(line, flush=True)


def pattern(mapping, l, blocks):
    d = mapping.geometry.dims
    row = d["channels"] * d["element_bytes"]
    shape = (blocks, d["heads"], d["block_tokens"], row)
    i = numpy.arange(numpy.prod(shape), dtype=numpy.uint64).reshape(shape)
    b = numpy.arange(blocks, dtype=numpy.uint64).reshape(blocks, 1, 1, 1)
    return ((7 * i + 13 * l + 29 * b) % 251 + 1).astype(numpy.uint8)


def view(mapping, l, blocks):
    return mapping.layer(l)[:blocks].view(numpy.uint8)  # [B, H, N, C*e] raw bytes (C is contiguous)


def main():
    socket, pool, parity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = kvd.connect(socket, client_name="restart-peer-py", timeout=5.0)
    restarted = threading.Event()
    last = {}

    def on_restart(r):
        last["r"] = r
        last["n"] = last.get("n", 0) + 1
        restarted.set()

    m = client.attach(pool, on_restart=on_restart, on_lost=lambda why: say(f"lost {why}"))
    layers, blocks = m.geometry.dims["layers"], m.committed_blocks
    patterns = {l: pattern(m, l, blocks) for l in range(layers)}
    for l in range(parity, layers, 2):
        view(m, l, blocks)[...] = patterns[l]
    say(f"ready {m.epoch}")

    writing = threading.Event()
    writing.set()

    def writer():  # the engine keeps using its cache while kvd is away
        while writing.is_set():
            for l in range(parity, layers, 2):
                view(m, l, blocks)[...] = patterns[l]

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    for command in sys.stdin:
        command = command.strip()
        if command == "wait_restart":
            restarted.wait(60)
            r = last.get("r")
            say(f"restarted epoch={r.epoch if r else 0} lost={len(r.lost_chunk_ids) if r else 0} "
                f"lost_bytes={r.lost_bytes if r else 0} returned={len(r.returned_chunk_ids) if r else 0} "
                f"restarts={last.get('n', 0)}")
        elif command == "probe":
            try:
                client.device_info()
                say("probe OK")
            except kvd.KvdError as e:
                say(f"probe {e.code}")
        elif command == "check":
            writing.clear()
            t.join()
            bad = sum(int(numpy.count_nonzero(view(m, l, blocks) != patterns[l])) for l in range(layers))
            nbytes = sum(p.size for p in patterns.values())
            say(f"checked {nbytes} bytes, {bad} differ")
        elif command == "quit":
            break
    writing.clear()
    m.close()
    client.close()


if __name__ == "__main__":
    main()
