"""The arbitration's promises (docs/api.md "Policy, waiting and reclaim", the RPCs SetPoolPolicy, ReportUsage and
DeclineReclaim, the proto's PoolPolicy, PoolUsage, ReclaimState, WaitingRequest, DeviceInfo and RECLAIM fields, and
docs/metrics.md "Arbitration" and "Host tier"), one by one, on the real kvd (host backend) over its sockets.

The "GPU" is full as in reclaim_test.py: 512 MiB of its 1 GiB used by "other processes" (--host-used-by-others) and
64 MiB of headroom, so kvd can back 448 MiB although its budget is 900 MiB. Engines are Python package Clients with
pausable Mappings; malformed requests go through grpcio itself (Raw), so that what reaches the daemon is exactly
the request written here. Every wait is bounded; nothing asserts on wall-clock time.

Run: KVD_BINARY=<build>/daemon/kvd KVCTL_BINARY=<build>/client/kvctl/kvctl KVD_LIBRARY=<build>/client/libkvd_c.so \
     PYTHONPATH=<src>/client/python:<src>/tests/testing KVD_PYTHON_GEN_DIR=<build>/python \
     /usr/bin/python3 arbitration_api_test.py -v
"""
import os
import re
import threading
import time
import unittest

import grpc

import kvd
from kvd_daemon import KvdDaemonCase, kvctl
from scrape import free_port, http_get, parse_samples, poll

pb = kvd.v1_pb2
MiB = 1 << 20
# 2 layers, 8 heads, 16 tokens, 128 channels, fp16: 64 KiB a block (two segments), 512 MiB at capacity.
DIMS = dict(layers=2, capacity_blocks=8192, heads=8, block_tokens=16, channels=128, element_bytes=2)
PER_MIB = 16  # blocks per MiB
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs")


class Raw:
    """kvd.v1.Kvd on the control socket through grpcio, with a Client's session token."""

    def __init__(self, socket, token):
        self.channel = grpc.insecure_channel("unix:" + socket)
        self.token = token

    def __call__(self, method, request, timeout=30, session=True):
        desc = pb.DESCRIPTOR.services_by_name["Kvd"].methods_by_name[method]
        call = self.channel.unary_unary(f"/kvd.v1.Kvd/{method}", request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=getattr(pb, desc.output_type.name).FromString)
        return call(request, metadata=[("kvd-session", self.token)] if session else None, timeout=timeout)

    def error(self, method, request, timeout=30):
        """(code name, message) of a call that must fail; it carries no status details (docs/api.md, "Errors":
        only a tenant limit's refusal has them)."""
        try:
            self(method, request, timeout)
        except grpc.RpcError as e:
            details = [k for k, _ in e.trailing_metadata() or () if k == "grpc-status-details-bin"]
            assert not details, f"{method}: {e.details()} carries status details"
            return e.code().name, e.details()
        raise AssertionError(f"{method}({request}) succeeded")

    def close(self):
        self.channel.close()


class Engine:
    """A Client (a session of its own) with a pausable Mapping of its pool, grown in 64 MiB steps (so that its
    chunks end every 1024 blocks). Its reclaim hook records each RECLAIM and, with `give`, answers it with
    shrink_for_reclaim (nothing live); else it returns without giving anything (the deadline or a decline decides)."""

    def __init__(self, socket, name, mib, give=False, **policy):
        self.name, self.give = name, give
        self.c = kvd.connect(socket, client_name=name)
        self.c.create_pool(name, **DIMS, **policy)
        self.requests = []
        self.m = self.c.attach(name, on_pause=lambda ranges: None, on_resume=lambda applied: None,
                               on_reclaim=self._reclaim)
        for at in range(1024, mib * PER_MIB + 1024, 1024):
            self.c.grow(name, min(at, mib * PER_MIB))

    def _reclaim(self, request):
        self.requests.append(request)
        if self.give:
            self.c.shrink_for_reclaim(request, [])

    def close(self):
        self.m.close()
        self.c.close()


class Grower(threading.Thread):
    """client.grow(pool, blocks, wait=True, wait_for=...) on a thread of its own: .result or .error once joined."""

    def __init__(self, client, pool, blocks, wait_for=30):
        super().__init__(daemon=True)
        self.args = (client, pool, blocks, wait_for)
        self.result = self.error = None
        self.start()

    def run(self):
        client, pool, blocks, wait_for = self.args
        try:
            self.result = client.grow(pool, blocks, wait=True, wait_for=wait_for)
        except kvd.KvdError as e:
            self.error = e


class ArbitrationCase(KvdDaemonCase):
    def kvd_args(self):
        self.port = free_port()
        return ["--host-capacity=1GiB", "--host-used-by-others=512MiB", "--budget=900MiB", "--device-headroom=64MiB",
                "--reclaim-timeout=20s", "--host-tier-bytes=64MiB", "--state-dir=${dir}/state",
                f"--metrics-address=127.0.0.1:{self.port}"]

    def setUp(self):
        super().setUp()
        self.op = kvd.connect(self.socket, client_name="operator")  # the daemon's own uid: an operator
        self.addCleanup(self.op.close)
        self.raw = Raw(self.socket, self.op.session.token)
        self.addCleanup(self.raw.close)

    def engine(self, *args, **kwargs):
        e = Engine(self.socket, *args, **kwargs)
        self.addCleanup(e.close)
        return e

    def grower(self, client, pool, mib, wait_for=30):
        g = Grower(client, pool, mib * PER_MIB, wait_for)
        self.addCleanup(g.join, 60)
        return g

    def kvctl(self, *args):
        return kvctl(self.socket, *args)

    def metrics(self):
        return parse_samples(http_get(f"http://127.0.0.1:{self.port}/metrics"))

    @staticmethod
    def value(samples, name, **labels):
        """The sample of `name` whose labels include `labels` (None: no such series)."""
        for (n, ls), v in samples.items():
            if n == name and set(labels.items()) <= set(ls):
                return v
        return None

    def waiting(self, pool):
        return poll(lambda: self.op.pool(pool).waiting, f"a grow of pool {pool} waiting for memory")


class ArbitrationApiTest(ArbitrationCase):
    def test_device_info_and_its_metrics_account_for_other_processes_and_the_headroom(self):
        d = self.raw("GetDeviceInfo", pb.GetDeviceInfoRequest(), session=False)  # no session needed
        self.assertEqual((d.headroom_bytes, d.foreign_bytes, d.available_bytes), (64 * MiB, 512 * MiB, 448 * MiB))
        self.assertEqual((d.waiting_requests, d.waiting_bytes, d.driver_out_of_memory), (0, 0, 0))
        self.op.create_pool("a", **DIMS)
        self.op.grow("a", 100 * PER_MIB)
        d = self.op.device_info()
        self.assertEqual(d.free_bytes, (1024 - 512 - 100) * MiB)
        self.assertEqual(d.foreign_bytes, 512 * MiB, "kvd's own 100 MiB are not foreign")
        self.assertEqual(d.available_bytes, (412 - 64) * MiB, "the device's free bytes less the headroom")
        m = self.metrics()
        device = dict(device="0", backend="host", uuid=d.device_uuid)
        self.assertEqual(self.value(m, "kvd_device_headroom_bytes", **device), 64 * MiB)
        self.assertEqual(self.value(m, "kvd_device_foreign_bytes", **device), 512 * MiB)
        self.assertEqual(self.value(m, "kvd_device_available_bytes", **device), 348 * MiB)
        self.assertEqual(self.value(m, "kvd_driver_out_of_memory_total", device="0"), 0)
        refused = self.value(m, "kvd_admission_refusals_total", device="0")
        device_refused = self.value(m, "kvd_admission_device_refusals_total", device="0")
        # A grow the device cannot back: RESOURCE_EXHAUSTED stating the bytes asked and what the device had;
        # nothing allocated.
        with self.assertRaises(kvd.KvdError) as e:
            self.op.grow("a", 500 * PER_MIB)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        for fragment in (f"needs {400 * MiB} bytes", f"but the device can back only {348 * MiB} bytes",
                         f"it has {412 * MiB} bytes", f"less {64 * MiB} bytes", "of headroom (--device-headroom)",
                         f"other processes use {512 * MiB} bytes"):
            self.assertIn(fragment, e.exception.message)
        self.assertEqual(self.op.pool("a").committed_bytes, 100 * MiB)
        self.assertEqual(self.op.device_info().available_bytes, 348 * MiB)
        # So is a create's initial commit; nothing is created.
        with self.assertRaises(kvd.KvdError) as e:
            self.op.create_pool("c", **DIMS, initial_blocks=400 * PER_MIB)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        self.assertIn(f"but the device can back only {348 * MiB} bytes", e.exception.message)
        self.assertEqual([p.name for p in self.op.pools()], ["a"])
        m = self.metrics()
        self.assertEqual(self.value(m, "kvd_admission_refusals_total", device="0"), refused + 2)
        self.assertEqual(self.value(m, "kvd_admission_device_refusals_total", device="0"), device_refused + 2)
        self.assertEqual(self.raw.error("Grow", pb.GrowRequest(pool="a", target_blocks=500 * PER_MIB))[0],
                         "RESOURCE_EXHAUSTED")
        # A cap refuses at once, waiting or not, naming the field.
        self.op.set_policy("a", max_bytes=128 * MiB)
        self.assertEqual(self.raw.error("Grow", pb.GrowRequest(pool="a", target_blocks=132 * PER_MIB, wait=True))[0],
                         "RESOURCE_EXHAUSTED")
        with self.assertRaises(kvd.KvdError) as e:
            self.op.grow("a", 132 * PER_MIB, wait=True, wait_for=20)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        self.assertRegex(e.exception.message, rf"^pool a: growing to {132 * PER_MIB} blocks would hold {132 * MiB} "
                                              rf"bytes .*, past its policy\.max_bytes of {128 * MiB} bytes")
        self.assertEqual(self.op.pool("a").committed_bytes, 100 * MiB)

    def test_released_memory_is_free_on_the_host_at_once_and_in_the_budget_until_unmapped(self):
        self.op.create_pool("p", **DIMS)
        for at in (1024, 1600):  # a 64 MiB chunk per segment, then 36 MiB more
            self.op.grow("p", at)
        viewer = kvd.connect(self.socket, client_name="viewer")  # not pausable: a forced release leaves it mapped
        self.addCleanup(viewer.close)
        m = viewer.attach("p", client_name="viewer")
        before = self.op.device_info()
        self.op.shrink("p", 1024, force=True)
        pool = self.op.pool("p")
        self.assertEqual((pool.committed_bytes, pool.pending_release_bytes), (64 * MiB, 36 * MiB))
        d = self.op.device_info()
        samples = self.metrics()
        self.assertEqual(self.value(samples, "kvd_pool_committed_bytes", pool="p"), 64 * MiB)
        self.assertEqual(self.value(samples, "kvd_pool_pending_release_bytes", pool="p"), 36 * MiB)
        self.assertEqual(self.value(samples, "kvd_device_committed_bytes"), d.committed_bytes)
        self.assertEqual(d.free_bytes, before.free_bytes + 36 * MiB, "the host backend frees it at once")
        self.assertEqual(d.committed_bytes, before.committed_bytes, "the budget counts it until it is unmapped")
        self.assertEqual(d.foreign_bytes, (512 - 36) * MiB, "low by the bytes pending release, on the host backend")
        self.assertEqual(d.available_bytes, min(900 * MiB - d.committed_bytes, d.free_bytes - 64 * MiB))
        m.close()
        poll(lambda: self.op.pool("p").pending_release_bytes == 0, "the viewer's release")
        d = self.op.device_info()
        self.assertEqual((d.committed_bytes, d.foreign_bytes), (before.committed_bytes - 36 * MiB, 512 * MiB))

    def test_malformed_policy_requests_name_the_field_and_change_nothing(self):
        self.op.create_pool("kv", **DIMS, priority=3, min_bytes=8 * MiB, reclaim_timeout=2, on_reclaim_timeout="shrink")
        self.op.create_pool("big", **DIMS, min_bytes=512 * MiB)
        before = self.op.pool("kv").policy
        P = pb.SetPoolPolicyRequest
        for request, code, fragment in [
                (P(pool="kv"), "INVALID_ARGUMENT", "policy: set at least one of priority, min_bytes, max_bytes, "
                                                   "reclaim_timeout_ms, on_reclaim_timeout"),
                (P(priority=1), "INVALID_ARGUMENT", "pool: must not be empty"),
                (P(pool="kv", priority=1001), "INVALID_ARGUMENT", "policy.priority: 1001"),
                (P(pool="kv", min_bytes=513 * MiB), "INVALID_ARGUMENT", "policy.min_bytes"),
                (P(pool="kv", max_bytes=4 * MiB), "INVALID_ARGUMENT", "more than policy.max_bytes"),
                (P(pool="kv", reclaim_timeout_ms=600001), "INVALID_ARGUMENT", "policy.reclaim_timeout_ms: 600001"),
                (P(pool="kv", on_reclaim_timeout=7), "INVALID_ARGUMENT", "policy.on_reclaim_timeout: 7"),
                (P(pool="kv", on_reclaim_timeout=pb.RECLAIM_ACTION_SLEEP), "INVALID_ARGUMENT",
                 "policy.on_reclaim_timeout: a sleep gives the whole pool back, below its policy.min_bytes"),
                # 512 MiB guaranteed to "big" and 400 to "kv" would pass the 900 MiB budget.
                (P(pool="kv", min_bytes=400 * MiB), "RESOURCE_EXHAUSTED", "policy.min_bytes: "),
                (P(pool="nope", priority=1), "NOT_FOUND", "pool nope does not exist")]:
            code_seen, message = self.raw.error("SetPoolPolicy", request)
            self.assertEqual(code_seen, code, message)
            self.assertIn(fragment, message)
            self.assertEqual(self.op.pool("kv").policy, before, f"{request} changed the policy")
        self.assertIn(f"would pass the daemon's budget of {900 * MiB} bytes",
                      self.raw.error("SetPoolPolicy", P(pool="kv", min_bytes=400 * MiB))[1])
        # CreatePool checks its policy the same way, and creates nothing on a refusal.
        dims = pb.PoolDims(layers=2, capacity_blocks=8192, heads=8, block_tokens=16, channels=128, element_bytes=2)
        for policy, code, fragment in [(pb.PoolPolicy(priority=1001), "INVALID_ARGUMENT", "policy.priority"),
                                       (pb.PoolPolicy(on_reclaim_timeout=9), "INVALID_ARGUMENT",
                                        "policy.on_reclaim_timeout"),
                                       (pb.PoolPolicy(min_bytes=400 * MiB), "RESOURCE_EXHAUSTED", "policy.min_bytes")]:
            code_seen, message = self.raw.error("CreatePool", pb.CreatePoolRequest(name="new", dims=dims,
                                                                                   policy=policy))
            self.assertEqual((code_seen, fragment in message), (code, True), message)
            self.assertNotIn("new", [p.name for p in self.op.pools()])
        # Only the fields a request sets change; the record is saved and survives a restart.
        p = self.raw("SetPoolPolicy", P(pool="kv", priority=5, max_bytes=64 * MiB))
        self.assertEqual((p.policy.priority, p.policy.min_bytes, p.policy.max_bytes, p.policy.reclaim_timeout_ms,
                          p.policy.on_reclaim_timeout), (5, 8 * MiB, 64 * MiB, 2000, pb.RECLAIM_ACTION_SHRINK))
        self.assertFalse(p.policy_operator_bounds, "the pool's owner is an operator")
        self.op.report_usage("kv", live_blocks=0)
        self.assertTrue(self.op.pool("kv").HasField("usage"))
        self.raw.close()
        self.kvd.terminate()
        self.restart_daemon(0)
        after = poll(lambda: self._pool_after_restart("kv"), "the restarted daemon's pool kv")
        self.assertEqual(after.policy, p.policy)
        self.assertFalse(after.HasField("usage"), "usage reports are not kept across a restart")
        self.assertEqual(after.policy.min_bytes + self.op.pool("big").policy.min_bytes, 520 * MiB)

    def _pool_after_restart(self, name):
        try:
            return self.op.pool(name)
        except kvd.KvdError:
            return None

    def test_usage_reports_are_checked_and_rank_the_pools_a_reclaim_asks(self):
        # x and y (priority 0) and z (priority 1) hold 384 of the 448 MiB; b (priority 5) waits for 128: 64 short.
        x = self.engine("x", 96)
        y = self.engine("y", 128)
        z = self.engine("z", 160, give=True, priority=1)
        b = self.engine("b", 0, priority=5)
        # x reports every block live: it has nothing to give. Bad reports are refused, naming the field, and the
        # last good one stays.
        t0 = int(time.time() * 1000)
        x.c.report_usage("x", live_blocks=96 * PER_MIB - 10, evictable_blocks=10)
        t1 = int(time.time() * 1000)
        R = pb.ReportUsageRequest
        for request, code, fragment in [
                (R(pool="x", live_blocks=10, evictable_blocks=5, used_blocks=14), "INVALID_ARGUMENT",
                 "used_blocks: 14 is below live_blocks + evictable_blocks (10 + 5)"),
                (R(pool="x", live_blocks=1, used_blocks=96 * PER_MIB + 1), "INVALID_ARGUMENT",
                 f"used_blocks: {96 * PER_MIB + 1} is past the pool's committed blocks, {96 * PER_MIB}"),
                (R(live_blocks=1, used_blocks=1), "INVALID_ARGUMENT", "pool: must not be empty"),
                (R(pool="nope", used_blocks=0), "NOT_FOUND", "pool nope does not exist")]:
            self.assertEqual(self.raw.error("ReportUsage", request)[0], code)
            self.assertIn(fragment, self.raw.error("ReportUsage", request)[1])
        u = self.op.pool("x").usage
        self.assertEqual((u.live_blocks, u.evictable_blocks, u.used_blocks), (96 * PER_MIB - 10, 10, 96 * PER_MIB))
        self.assertTrue(t0 <= u.reported_at_unix_ms <= t1, (t0, u.reported_at_unix_ms, t1))
        self.assertFalse(self.op.pool("y").HasField("usage"), "unset until the engine reports")

        g = self.grower(b.c, "b", 128)
        poll(lambda: y.requests, "a RECLAIM for y")
        # The lowest priority first, then the most reclaimable: y (128 MiB above its floor), not x (its live
        # blocks hold it all), nor z (priority 1) while y may cover the shortfall.
        request = y.requests[0]
        self.assertEqual((request.pool, request.bytes), ("y", 64 * MiB))
        self.assertEqual((x.requests, z.requests), ([], []))
        r = self.op.pool("y").reclaim
        self.assertEqual((r.reclaim_id, r.asked_bytes), (request.reclaim_id, 64 * MiB))
        self.assertEqual(r.deadline_unix_ms, round(request.deadline * 1000), "the event's reclaim_deadline_unix_ms")
        self.assertIn(r.deadline_unix_ms - r.asked_at_unix_ms, (19999, 20000, 20001), "now + --reclaim-timeout")
        waiting = self.waiting("b")
        self.assertEqual((len(waiting), waiting[0].asked_bytes, waiting[0].position), (1, 128 * MiB, 1))
        self.assertGreater(waiting[0].waiting_since_unix_ms, 0)
        d = self.op.device_info()
        self.assertEqual((d.waiting_requests, d.waiting_bytes), (1, 128 * MiB))
        m = self.metrics()
        for name, labels, want in [("kvd_waiting_requests", {}, 1), ("kvd_waiting_bytes", {}, 128 * MiB),
                                   ("kvd_pool_waiting_requests", {"pool": "b"}, 1),
                                   ("kvd_pool_waiting_requests", {"pool": "y"}, 0),
                                   ("kvd_pool_reclaim_asked_bytes", {"pool": "y"}, 64 * MiB),
                                   ("kvd_pool_reclaim_asked_bytes", {"pool": "x"}, 0),
                                   ("kvd_reclaims_under_way", {}, 1), ("kvd_reclaim_asked_bytes_total", {}, 64 * MiB),
                                   ("kvd_pool_priority", {"pool": "z"}, 1)]:
            self.assertEqual(self.value(m, name, device="0", **labels), want, f"{name} {labels}")
        self.assertGreater(self.value(m, "kvd_waiting_longest_seconds", device="0"), 0)
        # kvctl top: the device's memory, what other processes use, every pool's claim, waiters and reclaims.
        top = self.kvctl("top", "--count", "1")
        self.assertIn("other processes 512 MiB, headroom 64.0 MiB", top)
        self.assertIn("1 waiting for 128 MiB", top)
        rows = {line.split()[0]: line for line in top.splitlines() if line.split()[:1] in (["y"], ["b"], ["z"])}
        self.assertIn(f"#{request.reclaim_id} asked 64.0 MiB, gave 0 B", rows["y"])
        self.assertIn("#1 for 128 MiB", rows["b"])
        self.assertRegex(rows["z"], r"\b1 +0 B +none +- +-$")  # PRIO MIN MAX WAITING RECLAIM
        self.assertIn(f"reclaim      #{request.reclaim_id} asked 64.0 MiB", self.kvctl("policy", "y"))

        # DeclineReclaim: malformed or stale answers are refused and leave the reclaim as it was.
        D = pb.DeclineReclaimRequest
        rid = request.reclaim_id
        for bad, code, fragment in [
                (D(pool="y"), "INVALID_ARGUMENT", "reclaim_id: must be > 0"),
                (D(reclaim_id=rid), "INVALID_ARGUMENT", "pool: must not be empty"),
                (D(pool="y", reclaim_id=rid + 100), "NOT_FOUND",
                 f"reclaim_id: no reclaim {rid + 100} of pool y is waiting for an answer"),
                (D(pool="x", reclaim_id=rid), "NOT_FOUND", f"reclaim_id: no reclaim {rid} of pool x"),
                (D(pool="nope", reclaim_id=rid), "NOT_FOUND", "pool nope does not exist")]:
            code_seen, message = self.raw.error("DeclineReclaim", bad)
            self.assertEqual((code_seen, fragment in message), (code, True), message)
        # A reason that is not UTF-8 never reaches kvd: protobuf refuses the request, and kvd says so.
        undecodable = self.raw.channel.unary_unary("/kvd.v1.Kvd/DeclineReclaim", request_serializer=bytes,
                                                   response_deserializer=pb.DeclineReclaimResponse.FromString)
        with self.assertRaises(grpc.RpcError) as e:
            undecodable(D(pool="y", reclaim_id=rid).SerializeToString() + b"\x1a\x01\xff",  # reason: 0xFF
                        metadata=[("kvd-session", self.raw.token)], timeout=30)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("request: the /kvd.v1.Kvd/DeclineReclaim request is not a valid kvd.v1.DeclineReclaimRequest",
                      e.exception.details())
        self.assertEqual(self.op.pool("y").reclaim.reclaim_id, rid)
        # A reason is kept to its first 256 bytes, cut where a character starts (here the 2-byte é at 255).
        reason = "b" * 255 + "\u00e9" + "tail"
        self.raw("DeclineReclaim", D(pool="y", reclaim_id=rid, reason=reason))
        # Declined: y's policy (NONE) does nothing, and kvd goes on to the next pool, z, which gives back.
        g.join(60)
        self.assertIsNone(g.error)
        self.assertEqual(g.result.pool.committed_bytes, 128 * MiB)
        self.assertEqual(len(z.requests), 1)
        self.assertEqual(z.requests[0].bytes, 64 * MiB)
        self.assertEqual((len(x.requests), len(y.requests)), (0, 1), "a pool is asked once per waiting request")
        py = self.op.pool("y")
        self.assertEqual((py.committed_bytes, py.reclaim.reclaim_id), (128 * MiB, 0))
        self.assertEqual(py.reclaim.last_outcome,
                         f"reclaim {rid} of 64.0 MiB: declined ({'b' * 255}); its policy does nothing more "
                         "(policy.on_reclaim_timeout NONE)")
        self.assertRegex(self.op.pool("z").reclaim.last_outcome, r"^reclaim \d+ of 64\.0 MiB: gave \d")
        code_seen, message = self.raw.error("DeclineReclaim", D(pool="y", reclaim_id=rid))
        self.assertEqual(code_seen, "NOT_FOUND")
        self.assertIn(f"(the last one: reclaim {rid} of 64.0 MiB: declined", message)
        m = self.metrics()
        for name, labels, want in [("kvd_waiting_requests", {}, 0), ("kvd_waiting_bytes", {}, 0),
                                   ("kvd_reclaims_under_way", {}, 0),
                                   ("kvd_pool_reclaim_asked_bytes", {"pool": "y"}, 0),
                                   ("kvd_reclaims_total", {"outcome": "declined"}, 1),
                                   ("kvd_reclaims_total", {"outcome": "gave"}, 1),
                                   ("kvd_reclaim_seconds_count", {"outcome": "declined"}, 1),
                                   ("kvd_reclaim_seconds_count", {"outcome": "gave"}, 1),
                                   ("kvd_wait_seconds_count", {"result": "ok"}, 1),
                                   ("kvd_wait_seconds_count", {"result": "failed"}, 0),
                                   ("kvd_reclaim_asked_bytes_total", {}, 128 * MiB)]:
            self.assertEqual(self.value(m, name, device="0", **labels), want, f"{name} {labels}")
        self.assertGreaterEqual(self.value(m, "kvd_reclaim_given_bytes_total", device="0"), 64 * MiB)
        self.assertGreater(self.value(m, "kvd_memory_pressure_seconds_total", device="0"), 0)
        self.assertEqual(self.op.device_info().waiting_requests, 0)

    def test_a_grow_within_its_guarantee_reclaims_from_any_priority_never_below_the_others_guarantee(self):
        # y (priority 5, 256 MiB guaranteed) holds 384 MiB; b (priority 0) grows within its own 128 MiB guarantee.
        y = self.engine("y", 384, priority=5, min_bytes=256 * MiB, on_reclaim_timeout="shrink")
        y.c.report_usage("y", live_blocks=0, used_blocks=1024)  # 64 MiB in use: below y's guarantee
        b = self.engine("b", 0, min_bytes=128 * MiB)
        g = self.grower(b.c, "b", 128)
        poll(lambda: y.requests, "a RECLAIM for y, of higher priority than b")
        self.assertEqual(y.requests[0].bytes, 64 * MiB)
        self.raw("DeclineReclaim", pb.DeclineReclaimRequest(pool="y", reclaim_id=y.requests[0].reclaim_id))
        g.join(60)
        self.assertIsNone(g.error)
        py = self.op.pool("y")
        self.assertEqual(py.committed_bytes, 256 * MiB, "the shrink to the reported blocks stops at min_bytes")
        self.assertIn(f"; shrunk to {256 * PER_MIB} blocks, what its policy.min_bytes holds (its engine reported 1024 "
                      "in use)", py.reclaim.last_outcome)
        self.assertEqual(self.value(self.metrics(), "kvd_reclaim_actions_total", device="0", action="shrink"), 1)

    def test_every_client_is_asked_and_a_reclaim_whose_grow_ended_is_called_off(self):
        y = self.engine("y", 400)
        viewer = kvd.connect(self.socket, client_name="viewer")  # another session's client of y
        self.addCleanup(viewer.close)
        seen = []
        viewer.attach("y", client_name="viewer", on_pause=lambda ranges: None, on_reclaim=seen.append)
        self.engine("b", 0, priority=5)
        # The call's deadline is 2 s: the wait ends a tenth of it before, with what it waited for.
        code, message = self.raw.error("Grow", pb.GrowRequest(pool="b", target_blocks=100 * PER_MIB, wait=True),
                                       timeout=2)
        self.assertEqual(code, "RESOURCE_EXHAUSTED")
        self.assertIn("pool y (priority 0) was asked for 52.0 MiB: gave 0 B so far", message)
        poll(lambda: seen and y.requests, "the RECLAIM at both clients")
        self.assertEqual((seen[0].reclaim_id, seen[0].bytes), (y.requests[0].reclaim_id, 52 * MiB))
        # Called off: nothing done to y.
        py = poll(lambda: (lambda p: p if p.reclaim.reclaim_id == 0 else None)(self.op.pool("y")), "the reclaim's end")
        self.assertEqual(py.reclaim.last_outcome,
                         f"reclaim {seen[0].reclaim_id} of 52.0 MiB: called off: the grow it was asked for ended")
        self.assertEqual((py.state, py.committed_bytes), (pb.POOL_STATE_AWAKE, 400 * MiB))
        m = self.metrics()
        self.assertEqual(self.value(m, "kvd_reclaims_total", device="0", outcome="called_off"), 1)
        self.assertEqual(self.value(m, "kvd_wait_seconds_count", device="0", result="failed"), 1)

    def test_a_sleep_policy_without_room_in_the_tier_sleeps_losing_the_contents(self):
        y = self.engine("y", 384, on_reclaim_timeout="sleep")  # more than the 64 MiB tier holds
        b = self.engine("b", 0, priority=10)
        g = self.grower(b.c, "b", 128)
        poll(lambda: y.requests, "a RECLAIM for y")
        self.raw("DeclineReclaim", pb.DeclineReclaimRequest(pool="y", reclaim_id=y.requests[0].reclaim_id))
        g.join(60)
        self.assertIsNone(g.error)
        py = self.op.pool("y")
        self.assertEqual((py.state, py.kept_bytes, py.wake_blocks), (pb.POOL_STATE_SLEEPING, 0, 384 * PER_MIB))
        self.assertIn("declined; put to sleep, its contents lost (pool y: keeping its contents needs",
                      py.reclaim.last_outcome)
        self.assertEqual(self.value(self.metrics(), "kvd_reclaim_actions_total", device="0", action="sleep"), 1)

    def test_waiting_requests_queue_by_priority_and_hold_back_requests_behind_them(self):
        hog = self.engine("hog", 400, priority=9)  # of higher priority than every waiter: never asked
        q = self.engine("q", 0, priority=5)
        lo = self.engine("lo", 0)
        hi = self.engine("hi", 0, priority=9)
        self.op.create_pool("w", **DIMS, priority=5)  # asleep, to wake with wait below
        self.op.grow("w", 4 * PER_MIB)
        self.op.sleep("w")
        g = self.grower(q.c, "q", 100)
        self.waiting("q")
        # A request that does not wait is refused while a waiting request of at least its priority comes first
        # — also one of the waiting request's own pool — and admitted past waiters of lower priority.
        other = kvd.connect(self.socket, client_name="other")
        self.addCleanup(other.close)
        for engine in (lo, q):
            with self.assertRaises(kvd.KvdError) as e:
                other.grow(engine.name, 2 * PER_MIB)
            self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
            self.assertRegex(e.exception.message, r"but 1 grow or wake waiting for memory comes first \(the first: "
                                                  rf"priority 5, waiting \S+ for {100 * MiB} bytes")
            self.assertTrue(e.exception.message.endswith("; GrowRequest.wait queues behind them"), e.exception.message)
            self.assertEqual(self.op.pool(engine.name).committed_blocks, 0)
        hi.c.grow("hi", 2 * PER_MIB)
        # A waiting grow holds no lock of its pool: its pool's other calls go on.
        self.assertEqual(self.op.set_policy("q", max_bytes=200 * MiB).policy.max_bytes, 200 * MiB)
        # Waiting requests of the same priority queue in arrival order (a wake too), those of lower priority
        # behind them.
        woken = {}
        t = threading.Thread(target=lambda: woken.update(u=self.op.wake("w", wait=True, wait_for=30)), daemon=True)
        t.start()
        self.addCleanup(t.join, 60)
        self.waiting("w")
        g2 = self.grower(lo.c, "lo", 4)
        self.waiting("lo")
        self.assertEqual([self.op.pool(p).waiting[0].position for p in ("q", "w", "lo")], [1, 2, 3])
        d = self.op.device_info()
        self.assertEqual((d.waiting_requests, d.waiting_bytes), (3, 108 * MiB))
        code, message = self.raw.error("Wake", pb.WakeRequest(all=True, wait=True))
        self.assertEqual(code, "INVALID_ARGUMENT")
        self.assertTrue(message.startswith("wait: "), message)
        self.assertFalse(self.op.pool("hog").HasField("reclaim"), "a pool of higher priority is never asked")
        self.assertEqual(hog.requests, [])
        # Memory comes free: both are served.
        hog.close()
        self.op.delete("hog", force=True)
        for grower, pool, mib in ((g, "q", 100), (g2, "lo", 4)):
            grower.join(60)
            self.assertIsNone(grower.error, pool)
            self.assertEqual(grower.result.pool.committed_bytes, mib * MiB)
        t.join(60)
        self.assertEqual(woken["u"][0].pool.committed_bytes, 4 * MiB)
        self.assertEqual(self.value(self.metrics(), "kvd_wait_seconds_count", device="0", result="ok"), 3)

    def test_deadline_actions_that_cannot_act_fail_the_waiting_grow_saying_why(self):
        # a1 reports its usage but is mapped by an engine that is not pausable: the daemon's own shrink refuses;
        # a2 is pausable but never reported its usage: a SHRINK policy has nothing to shrink to.
        policy = dict(on_reclaim_timeout="shrink", reclaim_timeout=0.3)
        viewer = kvd.connect(self.socket, client_name="viewer")
        self.addCleanup(viewer.close)
        self.op.create_pool("a1", **DIMS, **policy)
        for at in (1024, 2048, 3072):
            self.op.grow("a1", at)
        self.op.report_usage("a1", live_blocks=0, used_blocks=1024)
        viewer.attach("a1", client_name="viewer")
        self.engine("a2", 192, **policy)
        b = self.engine("b", 0, priority=5)
        with self.assertRaises(kvd.KvdError) as e:
            b.c.grow("b", 128 * PER_MIB, wait=True, wait_for=4)
        self.assertEqual(e.exception.code, "RESOURCE_EXHAUSTED")
        message = e.exception.message
        self.assertRegex(message, r"; waited \S+: ")
        self.assertRegex(message, r"pool a1 \(priority 0\) was asked for 64\.0 MiB: gave 0 B by its deadline; "
                                  r"shrinking it failed: .*viewer")
        self.assertIn("pool a2 (priority 0) was asked for 64.0 MiB: gave 0 B by its deadline; its policy shrinks to "
                      "the blocks its engine reported in use, but it reported none", message)
        self.assertEqual([self.op.pool(p).committed_bytes for p in ("a1", "a2", "b")], [192 * MiB, 192 * MiB, 0])
        m = self.metrics()
        for name, labels, want in [("kvd_reclaim_actions_total", {"action": "shrink_failed"}, 1),
                                   ("kvd_reclaim_actions_total", {"action": "shrink_unreported"}, 1),
                                   ("kvd_reclaim_actions_total", {"action": "shrink"}, 0),
                                   ("kvd_reclaims_total", {"outcome": "timed_out"}, 2),
                                   ("kvd_wait_seconds_count", {"result": "failed"}, 1)]:
            self.assertEqual(self.value(m, name, device="0", **labels), want, f"{name} {labels}")

    def test_live_blocks_past_max_block_ids_are_refused_first_with_limit_exceeded(self):
        self.op.create_pool("kv", **DIMS)
        self.op.grow("kv", 64)
        refused = self.value(self.metrics(), "kvd_limit_refusals_total", device="0", limit="max-block-ids") or 0
        live = range(65537)
        for method, request in [("Sleep", pb.SleepRequest(pool="kv", keep=True, live_blocks=live)),
                                ("Sleep", pb.SleepRequest(pool="nope", keep=True, live_blocks=live)),
                                ("Prepare", pb.PrepareRequest(pool="kv", operation=pb.OPERATION_SLEEP, keep=True,
                                                              live_blocks=live))]:
            with self.assertRaises(grpc.RpcError) as e:
                self.raw(method, request)
            self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("live_blocks: 65537 in one request, more than 65536 (--max-block-ids)", e.exception.details())
            details = dict(e.exception.trailing_metadata())["grpc-status-details-bin"]
            exceeded = pb.LimitExceeded()
            self.assertTrue(pb.RpcStatus.FromString(details).details[0].Unpack(exceeded))
            self.assertEqual((exceeded.limit, exceeded.uid, exceeded.allowed, exceeded.used, exceeded.asked),
                             ("max-block-ids", os.geteuid(), 65536, 0, 65537))
        pool = self.op.pool("kv")
        self.assertEqual((pool.state, pool.committed_blocks, pool.transaction), (pb.POOL_STATE_AWAKE, 64, ""))
        self.assertEqual(self.value(self.metrics(), "kvd_limit_refusals_total", device="0", limit="max-block-ids"),
                         refused + 3)

    def test_a_waiting_grow_fails_unavailable_when_kvd_stops(self):
        self.engine("hog", 440, priority=9)
        self.op.create_pool("q", **DIMS)
        failed = {}

        def grow():
            try:
                self.raw("Grow", pb.GrowRequest(pool="q", target_blocks=100 * PER_MIB, wait=True), timeout=60)
            except grpc.RpcError as e:
                failed["error"] = (e.code().name, e.details())

        t = threading.Thread(target=grow, daemon=True)
        t.start()
        self.waiting("q")
        self.kvd.terminate()
        t.join(60)
        self.assertEqual(failed.get("error"), ("UNAVAILABLE", "kvd is shutting down"))


class MetricsTableTest(ArbitrationCase):
    """Every metric docs/metrics.md lists under "Device", "Arbitration" and "Host tier" is on a real scrape with the
    documented name, type and labels, once a reclaim and a keeping sleep happened."""

    @staticmethod
    def documented(section):
        """{name: (type, labels beyond `device`)} of the table and the per-pool line of one section: the labels its
        heading names for every row, and those a row's meaning names ("by `outcome`")."""
        with open(os.path.join(DOCS, "metrics.md"), encoding="utf-8") as f:
            text = f.read()
        heading, body = text.split(f"\n## {section} (", 1)[1].split("\n## ", 1)[0].split("\n", 1)
        every = set(re.findall(r"`(\w+)`(?: =|[,;)])", heading)) - {"device"}
        found = {}
        for name, kind, meaning in re.findall(r"^\| `(kvd_\w+)` \| (\w+) \| (.*) \|$", body, re.M):
            labels = every | set(re.findall(r"by `(\w+)`", meaning))
            if "direction=" in meaning:
                labels.add("direction")
            found[name] = (kind, labels)
        per_pool = re.search(r"Per pool \(labels `device`, `pool`\): (.*?)\n\n", body, re.S)
        if per_pool:
            for name in re.findall(r"`(kvd_\w+)`", per_pool.group(1)):
                found[name] = ("gauge", {"pool"})
        return found

    def test_every_documented_device_arbitration_and_host_tier_metric_is_served(self):
        self.op.create_pool("kept", **DIMS)
        self.op.grow("kept", PER_MIB)
        self.op.sleep("kept", keep=True, live_blocks=[0])
        self.assertEqual(self.op.pool("kept").kept_bytes, 64 << 10)
        self.engine("a", 384, give=True)
        b = self.engine("b", 0, priority=10)
        g = self.grower(b.c, "b", 128)
        g.join(60)
        self.assertIsNone(g.error)
        text = http_get(f"http://127.0.0.1:{self.port}/metrics")
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        samples = parse_samples(text)
        documented = {**self.documented("Device"), **self.documented("Arbitration"), **self.documented("Host tier")}
        self.assertGreaterEqual(len(documented), 34, documented)
        self.assertEqual(documented["kvd_device_foreign_bytes"], ("gauge", {"backend", "uuid"}))
        for name, (kind, labels) in documented.items():
            self.assertEqual(types.get(name), kind, f"{name}: # TYPE")
            series = [dict(ls) for (n, ls) in samples if n == (name + "_count" if kind == "histogram" else name)]
            self.assertTrue(series, f"{name}: no series")
            for ls in series:
                self.assertEqual(ls.get("device"), "0", f"{name}: {ls}")
                self.assertTrue(labels <= set(ls), f"{name}: labels {sorted(ls)}, documented {sorted(labels)}")
        # The label values the table names are the ones served.
        self.assertEqual({dict(ls)["outcome"] for (n, ls) in samples if n == "kvd_reclaims_total"},
                         {"gave", "declined", "timed_out", "no_answer", "gone", "called_off"})
        self.assertEqual({dict(ls)["action"] for (n, ls) in samples if n == "kvd_reclaim_actions_total"},
                         {"shrink", "sleep", "shrink_failed", "sleep_failed", "shrink_unreported"})
        self.assertEqual({dict(ls)["result"] for (n, ls) in samples if n == "kvd_wait_seconds_count"}, {"ok", "failed"})
        self.assertEqual({dict(ls)["direction"] for (n, ls) in samples if n == "kvd_host_tier_copied_bytes_total"},
                         {"to_host", "to_device"})
        self.assertEqual(self.value(samples, "kvd_pool_waiting_requests", pool="b"), 0)
        self.assertEqual(self.value(samples, "kvd_pool_priority", pool="b"), 10)
        # The tier holds the kept 64 KiB in an extent of the granularity (2 MiB).
        self.assertEqual(self.value(samples, "kvd_host_tier_used_bytes"), 2 * MiB)


if __name__ == "__main__":
    unittest.main(verbosity=2)
