"""The client scenarios (tests/client/scenarios/*.json, schema scenario.proto) run with the Python package
kvd: one unittest test per file. tests/client/scenario_test.cc runs the same files with libkvd, so both
clients are held to one behaviour.

Run: KVD_BINARY=<build>/daemon/kvd KVD_SCENARIO_DIR=<src>/tests/client/scenarios \
     KVD_SCENARIO_PROTO_DIR=<build>/tests/scenarios PYTHONPATH=<src>/client/python \
     KVD_PYTHON_GEN_DIR=<build>/python \
     KVD_LIBRARY=<build>/client/libkvd_c.so /usr/bin/python3 scenario_test.py [ScenarioTest.test_<name>]

Each scenario starts its own daemons (tests/testing/kvd_daemon.py: real kvd processes on the host
backend, sockets in one fresh directory) and runs its steps in order; a step's status and what it
observed are compared with its `expect`. Waits ("eventually") are bounded polls of a condition.
"""

import os
import signal
import sys
import threading
import time
import unittest

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testing"))
sys.path.insert(0, os.environ.get("KVD_SCENARIO_PROTO_DIR") or ".")

import kvd  # noqa: E402
import scenario_pb2  # noqa: E402  (generated from scenario.proto at build time)
from google.protobuf import json_format  # noqa: E402
from kvd_daemon import KvdDaemonCase  # noqa: E402

SCENARIO_DIR = os.environ.get("KVD_SCENARIO_DIR") or os.path.join(HERE, "..", "scenarios")
EVENTUALLY_S = 20.0


def scenario_names():
    return sorted(f[:-len(".json")] for f in os.listdir(SCENARIO_DIR) if f.endswith(".json"))


def load_scenario(name):
    with open(os.path.join(SCENARIO_DIR, name + ".json"), encoding="utf-8") as f:
        return json_format.Parse(f.read(), scenario_pb2.Scenario())  # unknown keys fail, as in C++


def pattern_byte(seed, layer, block):
    """Never zero, so fresh (zeroed) memory never passes for it. As scenario_test.cc."""
    return (seed * 131 + layer * 31 + block * 7) % 251 + 1


def pool_state_name(state):
    return kvd.v1_pb2.PoolState.Name(state)[len("POOL_STATE_"):].lower()


class Recorder:
    """What a Mapping's callbacks reported."""

    def __init__(self):
        self.lock = threading.Lock()
        self.grows = self.releases = self.lost = self.restarts = 0
        self.pauses = self.resumes = 0
        self.pausable = False
        self.resume_applied = None
        self.blocks = None
        self.why = None
        self.restart = None

    def on_grow(self, committed_blocks):
        with self.lock:
            self.grows += 1
            self.blocks = committed_blocks

    def on_release(self, committed_blocks):
        with self.lock:
            self.releases += 1
            self.blocks = committed_blocks

    def on_lost(self, why):
        with self.lock:
            self.lost += 1
            self.why = why

    def on_restart(self, restart):
        with self.lock:
            self.restarts += 1
            self.restart = restart

    def on_pause(self, ranges):
        with self.lock:
            self.pauses += 1

    def on_resume(self, applied):
        with self.lock:
            self.resumes += 1
            self.resume_applied = applied


def observe_pool(p, o):
    o.committed_blocks = p.committed_blocks
    o.state = pool_state_name(p.state)
    o.pending_release_bytes = p.pending_release_bytes
    o.clients = p.client_count
    o.held = bool(p.transaction)
    o.layout = p.layout.layout
    o.rule = kvd.layout_rule_name(p.layout.rule)
    o.warnings_contain.extend(p.layout.warnings)


def observe_pools(pools, o):
    """Ranks or updates that agree on their pool's blocks and state report them once."""
    if pools and all(p.committed_blocks == pools[0].committed_blocks and p.state == pools[0].state for p in pools):
        o.committed_blocks = pools[0].committed_blocks
        o.state = pool_state_name(pools[0].state)


def mismatches(want, got):
    """Every field set in `want` must be set in `got` and equal; the *_contain(s) fields must each be a
    substring of one observed entry. As scenario_test.cc."""
    out = []
    for f in want.DESCRIPTOR.fields:
        if f.name in ("code", "message_contains"):
            continue
        if f.label == f.LABEL_REPEATED:
            for needle in getattr(want, f.name):
                if not any(needle in entry for entry in getattr(got, f.name)):
                    out.append(f'{f.name}: no entry contains "{needle}"')
            continue
        if not want.HasField(f.name):
            continue
        if not got.HasField(f.name):
            out.append(f"{f.name}: not observed by this step")
            continue
        w, g = getattr(want, f.name), getattr(got, f.name)
        if w != g:
            out.append(f"{f.name}: expected {str(w).lower() if isinstance(w, bool) else w}, "
                       f"got {str(g).lower() if isinstance(g, bool) else g}")
    return out


class StepError(Exception):
    """A runner-side failure (a write or read of the pattern, an unknown name): DATA_LOSS / INTERNAL."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code, self.message = code, message


class Run:
    def __init__(self, case, scenario):
        self.case = case
        self.scenario = scenario
        self.sockets = []
        self.uuids = []
        self.clients = {}
        self.mappings = {}  # name -> (Mapping, Recorder)
        self.owned = {}  # client name -> [mapping names]
        self.groups = {}
        self.txns = {}
        self.kill_before_commit = None

    def start_daemons(self):
        for i, d in enumerate(self.scenario.daemons):
            self.sockets.append(self.case.socket if i == 0 else self.case.start_daemon(i, *d.args))
        for s in self.sockets:
            with kvd.connect(s, client_name="scenario") as c:
                self.uuids.append(c.device_info().device_uuid)

    def close(self):
        for g in self.groups.values():
            g.close()
        for m, _ in self.mappings.values():
            m.close()
        for c in self.clients.values():
            c.close()

    def expand(self, s):
        for i, u in enumerate(self.uuids):
            s = s.replace(f"${{uuid:{i}}}", u)
        if self.uuids:
            s = s.replace("${uuid_family}", self.uuids[0].rstrip("0123456789"))
        return s

    @staticmethod
    def dims(d):
        return dict(layers=d.layers, capacity_blocks=d.capacity_blocks, heads=d.heads, block_tokens=d.block_tokens,
                    channels=d.channels, element_bytes=d.element_bytes)

    @staticmethod
    def layout(l):
        return dict(override=l.override_layout or None,
                    backend_requirements={r.backend: list(r.layouts) for r in l.backend_requirements},
                    connector_preferences=[(p.connector, p.layout) for p in l.connector_preferences],
                    env_layout=l.env_layout if l.HasField("env_layout") else None)

    @staticmethod
    def observe_mapping(m, rec, o):
        o.committed_blocks = m.committed_blocks
        o.state = "lost" if m.gone is not None else pool_state_name(m.state)
        o.mapped_chunks = len(m.mapped_chunks)
        o.epoch = m.epoch
        o.layout = m.geometry.layout
        o.rule = m.geometry.rule
        o.warnings_contain.extend(m.layout_resolution.warnings)
        with rec.lock:
            o.on_grow, o.on_release, o.on_lost, o.on_restart = rec.grows, rec.releases, rec.lost, rec.restarts
            if rec.pausable:
                o.on_pause, o.on_resume = rec.pauses, rec.resumes
            if rec.resume_applied is not None:
                o.resume_applied = rec.resume_applied
            if rec.restart is not None:
                o.restart_epoch = rec.restart.epoch
                o.lost_chunks = len(rec.restart.lost_chunk_ids)
                o.returned_chunks = len(rec.restart.returned_chunk_ids)
            if rec.blocks is not None:
                o.callback_blocks = rec.blocks
            if rec.why is not None:
                o.lost_code = rec.why.code
                o.lost_message_contains.append(rec.why.message)

    def mapping(self, name):
        if name not in self.mappings:
            raise StepError("INTERNAL", f"no mapping {name}")
        return self.mappings[name]

    def execute(self, step, o):
        op = step.op
        if op == "connect":
            socket = self.sockets[step.daemon] if not step.socket else os.path.join(self.case.dir, step.socket)
            self.clients[step.client] = kvd.connect(socket, client_name=step.client_name or None)
            return
        if op == "stop_daemon":
            proc = self.case.daemons[step.daemon]
            if step.kill:
                proc.kill()
                proc.wait()
            else:
                proc.send_signal(signal.SIGTERM)
            return
        if op == "restart_daemon":
            self.case.restart_daemon(step.daemon)
            return
        if op == "find_socket":
            socket = kvd.find_socket(self.expand(step.device), socket_dir=self.case.dir)
            if socket in self.sockets:
                o.daemon = self.sockets.index(socket)
            return
        if op in ("write_pattern", "check_pattern"):
            return self.pattern(step)
        if op == "mapping":
            m, rec = self.mapping(step.mapping)
            self.observe_mapping(m, rec, o)
            return
        if op == "detach":
            m, _ = self.mappings.pop(step.mapping)
            m.close()
            return
        if op.startswith("group_"):
            return self.group_step(step, o)

        c = self.clients.get(step.client)
        if c is None:
            raise StepError("INTERNAL", f'no client "{step.client}"')
        if op == "disconnect":
            for name in self.owned.pop(step.client, []):
                entry = self.mappings.pop(name, None)
                if entry is not None:
                    entry[0].close()
            self.clients.pop(step.client).close()
        elif op == "device_info":
            info = c.device_info()
            o.pools, o.epoch = info.pool_count, info.epoch
        elif op == "list_pools":
            o.pools = len(c.pools())
        elif op == "create_pool":
            group = kvd.GroupMembership.of((step.membership.name, step.membership.rank, step.membership.size)) \
                if step.HasField("membership") else None
            p = c.create_pool(step.pool, **self.dims(step.dims), initial_blocks=step.initial_blocks,
                              **self.layout(step.layout), group=group,
                              peer_devices=[self.expand(d) for d in step.peer_devices])
            observe_pool(p, o)
        elif op == "get_pool":
            p = c.pool(step.pool)
            observe_pool(p, o)
            o.pausable_clients = sum(1 for client in p.clients if client.pausable)
            o.chunks = len(p.chunks)
        elif op == "delete_pool":
            o.released_bytes = c.delete(step.pool, force=step.force)
        elif op == "resolve_layout":
            r = c.resolve_layout(**self.layout(step.layout), dims=self.dims(step.dims) if step.HasField("dims") else None)
            o.layout = r.resolution.layout
            o.rule = kvd.layout_rule_name(r.resolution.rule)
            o.warnings_contain.extend(r.resolution.warnings)
            o.has_geometry = r.HasField("geometry")
        elif op == "attach":
            rec = Recorder()
            rec.pausable = step.pausable
            hooks = dict(on_pause=rec.on_pause, on_resume=rec.on_resume) if step.pausable else {}
            m = c.attach(step.pool, on_grow=rec.on_grow, on_release=rec.on_release, on_lost=rec.on_lost,
                         on_restart=rec.on_restart,
                         client_name=step.client_name, device=self.expand(step.device) or None, **hooks)
            self.observe_mapping(m, rec, o)
            self.mappings[step.mapping] = (m, rec)
            self.owned.setdefault(step.client, []).append(step.mapping)
        elif op == "grow":
            observe_pool(c.grow(step.pool, step.blocks).pool, o)
        elif op in ("shrink", "compact"):
            pause = dict(pause_timeout=step.pause_timeout_ms / 1000 if step.pause_timeout_ms else None,
                         detach_unresponsive=step.detach_unresponsive)
            if op == "shrink":
                u = c.shrink(step.pool, step.blocks, wait=step.wait, whole_chunks_only=step.whole_chunks_only, **pause)
                o.target_reached = u.reshape.target_reached
            else:
                u = c.compact(step.pool, **pause)
            observe_pool(u.pool, o)
            o.chunks_before, o.chunks_after = u.reshape.chunks_before, u.reshape.chunks_after
            o.paused_clients = u.reshape.paused_clients
        elif op in ("sleep", "wake"):
            updates = c.sleep(step.pool, wait=step.wait) if op == "sleep" else c.wake(step.pool)
            o.pools = len(updates)
            observe_pools([u.pool for u in updates], o)
        elif op == "grant":
            observe_pool(c.grant_peer_access(step.pool, self.expand(step.device), revoke=step.revoke), o)
        elif op == "prepare":
            p = c.prepare(step.pool, step.operation, target_blocks=step.blocks, ttl=30.0)
            self.txns[step.txn] = p.transaction
            o.prepared_bytes = p.prepared_bytes
            observe_pool(p.pool, o)
        elif op == "commit":
            observe_pool(c.commit(self.txns[step.txn], wait=step.wait).pool, o)
        elif op == "abort":
            o.released_bytes = c.abort(self.txns[step.txn])
        else:
            raise StepError("INTERNAL", f'unknown op "{op}"')

    def group_step(self, step, o):
        op = step.op
        if op == "group_open":
            def before_commit():
                if self.kill_before_commit is not None:
                    proc = self.case.daemons[self.kill_before_commit]
                    proc.kill()
                    proc.wait()

            g = kvd.Group.open(step.group_name, sockets=[self.sockets[d] for d in step.daemons], timeout=5.0,
                               before_commit=before_commit)
            o.ranks = len(g.ranks)
            self.groups[step.group] = g
            return
        g = self.groups.get(step.group)
        if g is None:
            raise StepError("INTERNAL", f"no group {step.group}")
        self.kill_before_commit = step.kill_before_commit if step.HasField("kill_before_commit") else None
        try:
            if op == "group_grow":
                change = g.grow(step.blocks)
            elif op == "group_shrink":
                change = g.shrink(step.blocks, wait=step.wait)
            elif op == "group_sleep":
                change = g.sleep(wait=step.wait)
            elif op == "group_wake":
                change = g.wake()
            else:
                raise StepError("INTERNAL", f'unknown op "{op}"')
        finally:
            self.kill_before_commit = None
        o.ranks = len(change.ranks)
        o.prepared_bytes = change.prepared_bytes
        observe_pools([u.pool for u in change.ranks], o)

    def pattern(self, step):
        """The first byte of elements (b, 0, 0, 0) and (b, H-1, N-1, C-1) of every layer of every listed
        block, through the mapping's layer views (as raw bytes: C becomes C*e)."""
        m, _ = self.mapping(step.mapping)
        d = m.geometry.dims
        e = d["element_bytes"]
        for layer in range(d["layers"]):
            raw = m.layer(layer).view(numpy.uint8)
            for b in step.block_ids:
                want = 0 if step.zero else pattern_byte(step.seed, layer, b)
                first = (b, 0, 0, 0)
                last = (b, d["heads"] - 1, d["block_tokens"] - 1, (d["channels"] - 1) * e)
                if step.op == "write_pattern":
                    raw[first] = raw[last] = want
                elif raw[first] != want or raw[last] != want:
                    raise StepError("DATA_LOSS", f"layer {layer} block {b}: read {raw[first]} and {raw[last]}, "
                                    f"expected {want}")

    def check(self, step, error, o):
        want = step.expect
        want_code = want.code or "OK"
        got_code = "OK" if error is None else error.code
        if want_code != got_code:
            return [f"expected {want_code}, got {got_code}" + ("" if error is None else f": {error.message}")]
        message = "" if error is None else error.message
        bad = [f'message "{message}" lacks "{self.expand(m)}"' for m in want.message_contains
               if self.expand(m) not in message]
        if error is not None:
            return bad
        return bad + mismatches(want, o)

    def run_step(self, step):
        deadline = time.monotonic() + EVENTUALLY_S
        while True:
            o = scenario_pb2.Expect()
            try:
                self.execute(step, o)
                error = None
            except (kvd.KvdError, StepError) as e:
                error = e
            bad = self.check(step, error, o)
            if not bad or not step.eventually or time.monotonic() > deadline:
                return bad
            time.sleep(0.01)

    def steps(self):
        for i, step in enumerate(self.scenario.steps):
            bad = self.run_step(step)
            if bad:  # later steps build on this one
                where = f"step {i} ({step.op}{': ' + step.note if step.note else ''})"
                return [f"{where}: {b}" for b in bad]
        return []


class ScenarioTest(KvdDaemonCase):
    def kvd_args(self):
        daemons = self.scenario.daemons
        return list(daemons[0].args) if daemons else []

    def setUp(self):
        name = self._testMethodName[len("test_"):]
        self.scenario = load_scenario(name)
        self.assertGreater(len(self.scenario.steps), 0)
        self.assertGreater(len(self.scenario.daemons), 0, "a scenario needs a daemon")
        super().setUp()

    def run_scenario(self):
        run = Run(self, self.scenario)
        run.start_daemons()
        self.addCleanup(run.close)  # before the daemons stop (cleanups run last-in first-out)
        failures = run.steps()
        if failures:
            logs = "".join(self._read(os.path.join(self.dir, f"kvd{i}.log")) for i in range(len(run.sockets)))
            self.fail("\n".join(failures) + "\n---- kvd logs ----\n" + logs)


def _add_tests():
    for name in scenario_names():
        setattr(ScenarioTest, f"test_{name}", lambda self: self.run_scenario())


_add_tests()

if __name__ == "__main__":
    unittest.main()
