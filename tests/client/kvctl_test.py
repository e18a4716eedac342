#!/usr/bin/env python3
"""kvctl end to end: the real kvctl binary against a real kvd on the host backend.

Checks every verb's --json output and exit status, the human output of a few verbs, and that a failure
prints exactly one line "kvctl: <reason>" on stderr with a non-zero exit status. --json prints the
daemon's replies as proto3 JSON: each is parsed back into its kvd.v1 message (an unknown key fails), and
carries every scalar and repeated field of the message (so a new proto field shows up without a kvctl
change). $KVD_BINARY and $KVCTL_BINARY name the binaries, $PYTHONPATH finds kvd/v1 (ctest sets them).
"""
import json
import re
import os
import subprocess
import sys
import unittest

from google.protobuf import descriptor, json_format

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from kvd_daemon import KvdDaemonCase  # noqa: E402

from kvd.v1 import kvd_pb2  # noqa: E402

KVCTL = os.environ.get("KVCTL_BINARY", "kvctl")
WAIT_S = 30
MiB = 1 << 20

# 2 layers x 2 heads x 16 tokens x 64 channels x 2 bytes: 8 KiB per block.
DIMS = ["--layers", "2", "--capacity-blocks", "2048", "--heads", "2", "--block-tokens", "16", "--channels", "64",
        "--element-bytes", "2"]


class KvctlCase(KvdDaemonCase):
    """Runs the real kvctl against the case's daemon."""

    def run_kvctl(self, *args, env=None, use_socket=True, socket=None):
        argv = [KVCTL] + (["--socket=" + (socket or self.socket)] if use_socket else []) + list(args)
        return subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S, env=env)

    def ok(self, *args, socket=None):
        r = self.run_kvctl(*args, socket=socket)
        self.assertEqual(r.returncode, 0, f"kvctl {' '.join(args)}: {r.stderr}")
        self.assertEqual(r.stderr, "")
        return r.stdout

    def json(self, *args, socket=None):
        return json.loads(self.ok("--json", *args, socket=socket))

    def proto(self, doc, message_type):
        """`doc` as the kvd.v1 message `message_type`, checking it is one in proto3 JSON: no unknown key,
        every scalar and repeated field present (message fields only when set), at every level."""
        self.assert_every_field(doc, message_type.DESCRIPTOR)
        return json_format.ParseDict(doc, message_type())

    def assert_every_field(self, doc, desc):
        self.assertIsInstance(doc, dict)
        for field in desc.fields:
            value = doc.get(field.name)
            if field.message_type is None or field.label == descriptor.FieldDescriptor.LABEL_REPEATED:
                self.assertIn(field.name, doc, f"{desc.full_name}: {field.name} missing from {doc}")
            if field.message_type is not None and value is not None:
                items = value if field.label == descriptor.FieldDescriptor.LABEL_REPEATED else [value]
                for item in items:
                    self.assert_every_field(item, field.message_type)

    def fails(self, *args, code=1):
        r = self.run_kvctl(*args)
        self.assertEqual(r.returncode, code, r.stdout + r.stderr)
        lines = r.stderr.splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertTrue(lines[0].startswith("kvctl: "), r.stderr)
        return lines[0]


class KvctlTest(KvctlCase):
    def test_status(self):
        s = self.json("status")
        self.assertEqual(sorted(s), ["reply", "socket"])
        self.assertEqual(s["socket"], self.socket)
        d = self.proto(s["reply"], kvd_pb2.DeviceInfo)
        self.assertEqual(d.backend, kvd_pb2.BACKEND_HOST)
        self.assertEqual(d.budget_bytes, 512 * MiB)
        self.assertEqual(d.granularity_bytes, 2 * MiB)
        self.assertEqual(d.committed_bytes, 0)
        self.assertEqual(d.pool_count, 0)
        self.assertTrue(d.device_uuid)
        # proto3 JSON: 64-bit integers are strings, 32-bit ones numbers, enums their names.
        self.assertEqual(s["reply"]["budget_bytes"], str(512 * MiB))
        self.assertEqual(s["reply"]["pool_count"], 0)
        self.assertEqual(s["reply"]["backend"], "BACKEND_HOST")
        human = self.ok("status")
        self.assertIn("512 MiB budget", human)
        # Restarts: the epoch and durability always, the uptime where the daemon reports its start.
        self.assertIn("epoch", s["reply"])
        self.assertIn("durability", s["reply"])
        self.assertIn("started_at_unix_ms", s["reply"])
        self.assertRegex(human, r"(?m)^epoch +%d$" % d.epoch)
        self.assertRegex(human, r"(?m)^durability +\S+: ")
        if d.started_at_unix_ms:
            self.assertRegex(human, r"(?m)^uptime +\d+[dhms]")

    def test_drain_deletes_every_pool(self):
        for name in ("kv-a", "kv-b"):
            self.ok("create", name, *DIMS, "--initial-blocks", "256")
        human = self.ok("drain")
        self.assertIn("deleted kv-a (1/2), released 4.00 MiB", human)
        self.assertIn("deleted kv-b (2/2), released 4.00 MiB", human)
        self.assertIn("drained 2 of 2 pools, released 8.00 MiB", human)
        self.assertEqual(self.json("status")["reply"]["pool_count"], 0)
        self.assertEqual(self.json("status")["reply"]["committed_bytes"], "0")
        self.ok("create", "kv-c", *DIMS, "--initial-blocks", "256")
        doc = self.json("drain")
        self.assertEqual(sorted(doc), ["deleted", "failed", "pools", "released_bytes", "skipped", "socket"])
        self.assertEqual((doc["deleted"], doc["skipped"], doc["failed"]), (1, 0, 0))
        self.assertEqual(doc["released_bytes"], str(4 * MiB))
        self.assertEqual(doc["pools"][0]["pool"], "kv-c")
        self.assertEqual(self.proto(doc["pools"][0]["reply"], kvd_pb2.DeletePoolResponse).released_bytes, 4 * MiB)
        self.assertIn("drained 0 of 0 pools", self.ok("drain"))

    def test_metadata_show_set_and_save(self):
        self.ok("create", "kv", *DIMS)
        self.assertEqual(self.ok("metadata", "kv"), "kv metadata: version 0, 0 B\n")
        blob = os.path.join(self.dir, "blob")
        with open(blob, "wb") as f:
            f.write(b"table\x00\x01" * 20)
        self.assertIn("--expected-version: required with --set", self.fails("metadata", "kv", "--set", blob))
        human = self.ok("metadata", "kv", "--set", blob, "--expected-version", "0")
        self.assertTrue(human.startswith("kv metadata: version 1, 140 B, updated "), human)
        self.assertIn("table\\x00\\x01", human)
        self.assertIn("(--out FILE for all of it)", human)
        line = self.fails("metadata", "kv", "--set", blob, "--expected-version", "0")
        self.assertIn("ABORTED", line)
        self.assertIn("at version 1, not 0", line)
        out = os.path.join(self.dir, "out")
        self.ok("metadata", "kv", "--out", out)
        with open(out, "rb") as f:
            self.assertEqual(f.read(), b"table\x00\x01" * 20)
        doc = self.proto(self.json("metadata", "kv"), kvd_pb2.PoolMetadata)
        self.assertEqual((doc.pool, doc.version, doc.data), ("kv", 1, b"table\x00\x01" * 20))

    def test_socket_from_environment(self):
        env = dict(os.environ, KVD_SOCKET=self.socket)
        r = self.run_kvctl("--json", "status", env=env, use_socket=False)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["socket"], self.socket)

    def test_pool_lifecycle(self):
        doc = self.json("create", "kv", *DIMS, "--initial-blocks", "1024", "--require", "FLASH_ATTN=layer-outermost",
                        "--connector", "nixl=LHBNC")
        p = self.proto(doc, kvd_pb2.Pool)
        self.assertEqual(p.name, "kv")
        self.assertEqual(doc["state"], "POOL_STATE_AWAKE")
        self.assertEqual(p.geometry.layout, "LHBNC")
        self.assertEqual(p.layout.rule, kvd_pb2.LAYOUT_RULE_CONNECTOR_PREFERENCE)
        self.assertEqual(p.geometry.segments, 4)
        self.assertEqual(p.geometry.dims.capacity_blocks, 2048)
        self.assertEqual(p.committed_blocks, 1024)  # one 2 MiB chunk per segment
        self.assertNotIn("group", doc)  # an unset message field is left out

        pools = self.proto(self.json("pools"), kvd_pb2.ListPoolsResponse).pools
        self.assertEqual([x.name for x in pools], ["kv"])
        table = self.ok("pools").splitlines()
        self.assertEqual(table[0].split(), ["NAME", "STATE", "LAYOUT", "BLOCKS", "COMMITTED", "PENDING", "CLIENTS",
                                            "PRIO", "MIN", "MAX", "WAITING", "RECLAIM"])
        self.assertEqual(table[1].split()[:4], ["kv", "awake", "LHBNC", "1024/2048"])

        d = self.proto(self.json("describe", "kv"), kvd_pb2.Pool)
        self.assertEqual(len(d.chunks), 4)
        self.assertEqual(d.geometry.stride_c, 2)
        self.assertEqual(list(d.clients), [])
        self.assertIn("strides", self.ok("describe", "kv"))

        doc = self.json("grow", "kv", "--bytes", "16MiB")  # 8 KiB blocks: 2048
        self.assertEqual(sorted(doc), ["reply", "round_trip_ms"])
        self.assertGreaterEqual(doc["round_trip_ms"], 0)
        g = self.proto(doc["reply"], kvd_pb2.PoolUpdate)
        self.assertEqual(g.pool.committed_blocks, 2048)
        self.assertEqual(g.pool.committed_bytes, 16 * MiB)
        self.assertEqual(len(g.added), 4)

        s = self.proto(self.json("shrink", "kv", "--blocks", "1024", "--wait")["reply"], kvd_pb2.PoolUpdate)
        self.assertEqual(s.pool.committed_blocks, 1024)
        self.assertEqual(len(s.released_chunk_ids), 4)
        self.assertEqual(s.pool.pending_release_bytes, 0)
        human = self.ok("grow", "kv", "--blocks", "2048")
        self.assertRegex(human, r"^grew kv to 2048 blocks \(16\.0 MiB\) in [0-9.]+ ms")

        doc = self.json("sleep", "kv", "--wait")
        self.assertGreaterEqual(doc["round_trip_ms"], 0)
        slept = self.proto(doc["reply"], kvd_pb2.PoolUpdates).updates
        self.assertEqual(len(slept), 1)
        self.assertEqual(slept[0].pool.state, kvd_pb2.POOL_STATE_SLEEPING)
        self.assertEqual(slept[0].pool.wake_blocks, 2048)
        self.assertEqual(self.json("status")["reply"]["committed_bytes"], "0")
        woken = self.proto(self.json("wake", "--all")["reply"], kvd_pb2.PoolUpdates).updates
        self.assertEqual([u.pool.state for u in woken], [kvd_pb2.POOL_STATE_AWAKE])
        self.assertEqual(woken[0].pool.committed_blocks, 2048)
        self.assertEqual(self.json("sleep", "--all")["reply"]["updates"][0]["pool"]["name"], "kv")
        self.assertEqual(self.json("wake", "kv")["reply"]["updates"][0]["pool"]["state"], "POOL_STATE_AWAKE")

        deleted = self.json("delete", "kv")
        self.assertEqual(deleted, {"pool": "kv", "reply": {"released_bytes": str(16 * MiB)}})
        self.assertEqual(self.json("pools"), {"pools": [], "next_page_token": ""})  # every page in one

    def test_layout_resolve(self):
        doc = self.json("layout", "resolve", "--require", "FA=LBHNC,LBNHC", "--connector", "nixl=LBNHC")
        r = self.proto(doc, kvd_pb2.ResolveLayoutResponse)
        self.assertEqual(r.resolution.layout, "LBNHC")
        self.assertEqual(doc["resolution"]["rule"], "LAYOUT_RULE_CONNECTOR_PREFERENCE")
        self.assertEqual(list(r.resolution.allowed_layouts), ["LBHNC", "LBNHC"])
        self.assertNotIn("geometry", doc)  # no dims, no geometry
        r = self.proto(self.json("layout", "resolve", "--env", "BLHNC", *DIMS), kvd_pb2.ResolveLayoutResponse)
        self.assertEqual(r.resolution.rule, kvd_pb2.LAYOUT_RULE_CLIENT_ENV)
        self.assertEqual(r.geometry.layout, "BLHNC")
        self.assertEqual(r.geometry.segments, 1)
        r = self.proto(self.json("layout", "resolve", "--override", "BHLNC", "--require", "FA=LBHNC"),
                       kvd_pb2.ResolveLayoutResponse)
        self.assertEqual(r.resolution.layout, "BHLNC")
        self.assertEqual(r.resolution.rule, kvd_pb2.LAYOUT_RULE_REQUEST_OVERRIDE)
        self.assertTrue(r.resolution.warnings)
        human = self.ok("layout", "resolve", "--override", "BHLNC", "--require", "FA=LBHNC")
        self.assertIn("warning", human)

    def test_failures_are_one_line(self):
        line = self.fails("describe", "missing")
        self.assertIn("NOT_FOUND", line)
        self.assertIn("missing", line)
        line = self.fails("create", "kv", *DIMS[:-2], "--element-bytes", "0")
        self.assertIn("INVALID_ARGUMENT", line)
        self.assertIn("dims.element_bytes", line)
        self.ok("create", "kv", *DIMS, "--initial-blocks", "512")
        self.assertIn("capacity", self.fails("grow", "kv", "--blocks", "4096"))
        self.assertIn("ALREADY_EXISTS", self.fails("create", "kv", *DIMS))
        self.fails("grow", "kv", code=2)  # neither --blocks nor --bytes: the library says why
        self.fails("grow", "kv", "--blocks", "1", "--bytes", "1MiB", code=2)
        self.fails("frobnicate", code=2)
        self.fails("layout", "resolve", "--require", "nonsense")
        r = subprocess.run([KVCTL, "--socket=" + os.path.join(self.dir, "none.sock"), "status"], capture_output=True,
                           text=True, timeout=WAIT_S)
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(r.stderr.splitlines()), 1)
        self.assertIn("UNAVAILABLE", r.stderr)

    def test_caps(self):
        s = self.json("caps")
        d = self.proto(s["reply"], kvd_pb2.DeviceInfo)
        c = d.capabilities
        self.assertTrue(c.posix_fd.supported)
        self.assertFalse(c.fabric.supported)
        self.assertNotIn(kvd_pb2.HANDLE_TYPE_FABRIC, d.handle_types)
        self.assertFalse(c.gpu_direct_rdma_vmm.supported)
        self.assertEqual(c.granularity_bytes, 2 * MiB)
        self.assertIn("capabilities", self.json("status")["reply"])  # status --json carries it too
        human = self.ok("caps")
        self.assertRegex(human, r"POSIX FD +yes")
        self.assertRegex(human, r"FABRIC +no")

    def test_transfer(self):
        self.ok("create", "kv", *DIMS, "--initial-blocks", "1024", "--layout", "LHBNC")
        doc = self.json("transfer", "kv")
        self.assertEqual(sorted(doc), ["pool", "reply"])
        t = self.proto(doc["reply"], kvd_pb2.DescribeTransferResponse)
        self.assertEqual(t.blocks, 1024)
        self.assertEqual(t.committed_blocks, 1024)
        self.assertEqual(len(t.descriptors), 1)  # every committed block: one run per segment, 4 segments
        self.assertEqual(t.descriptors[0].count, 4)
        t = self.proto(self.json("transfer", "kv", "--blocks", "0,2,4,6-7")["reply"], kvd_pb2.DescribeTransferResponse)
        self.assertEqual(t.blocks, 5)
        self.assertEqual(t.bytes, 5 * 2 * 2 * 16 * 64 * 2)
        self.assertIn("1 blocks", self.ok("transfer", "kv", "--blocks", "3"))
        self.assertIn("block_ids[1]: 1 repeats block_ids[0]", self.fails("transfer", "kv", "--blocks", "1,1"))
        self.assertIn("--blocks", self.fails("transfer", "kv", "--blocks", "two"))
        self.assertIn("NOT_FOUND", self.fails("transfer", "missing"))

    def test_compact_makes_one_chunk_per_segment(self):
        # 8 KiB blocks over 2 segments: 512 blocks are one 2 MiB chunk per segment.
        self.ok("create", "kv", *DIMS, "--initial-blocks", "512")
        for blocks in ("1024", "1536", "2048"):
            self.ok("grow", "kv", "--blocks", blocks)
        segments = self.proto(self.json("describe", "kv"), kvd_pb2.Pool).geometry.segments
        self.assertEqual(len(self.json("describe", "kv")["chunks"]), 4 * segments)
        doc = self.json("compact", "kv")
        self.assertEqual(sorted(doc), ["reply", "round_trip_ms"])
        u = self.proto(doc["reply"], kvd_pb2.PoolUpdate)
        self.assertEqual(u.reshape.chunks_before, 4 * segments)
        self.assertEqual(u.reshape.chunks_after, segments)
        self.assertEqual(u.reshape.copied_bytes, 16 * MiB)
        self.assertEqual(u.reshape.paused_clients, 0)  # nobody attached: the daemon copies alone
        self.assertEqual(u.reshape.steps, 1)  # in one step, whatever --chunks-per-pause says
        self.assertEqual(u.pool.committed_blocks, 2048)
        self.assertEqual(len(self.json("describe", "kv")["chunks"]), segments)
        self.ok("shrink", "kv", "--blocks", "1024")  # exact: one 4 MiB chunk per segment
        self.ok("grow", "kv", "--blocks", "2048")  # and a second one
        human = self.ok("compact", "kv", "--pause-timeout", "2s", "--detach-unresponsive")
        self.assertRegex(human, r"^compacted kv: 2048 blocks \(16\.0 MiB\) in [0-9.]+ ms\n")
        self.assertRegex(human, r"(?m)^chunks +%d before, %d after \(%d replaced, %d new\)$"
                         % (2 * segments, segments, 2 * segments, segments))
        self.assertRegex(human, r"(?m)^copied +16\.0 MiB on the device in [0-9.]+ ms$")
        self.assertRegex(human, r"(?m)^pause +none \(no client paused\)$")
        self.assertIn("--pause-timeout", self.fails("compact", "kv", "--pause-timeout", "soon"))
        self.assertIn("NOT_FOUND", self.fails("compact", "missing"))
        self.assertIn("--chunks-per-pause", self.fails("compact", "kv", "--chunks-per-pause", "0", code=2))
        self.assertRegex(self.ok("compact", "kv", "--chunks-per-pause", "1"), r"(?m)^chunks +%d before, %d after"
                         % (segments, segments))

    def test_shrink_exact_whole_chunks_and_live_blocks(self):
        self.ok("create", "kv", *DIMS, "--initial-blocks", "2048")  # one 8 MiB chunk per segment
        # Whole chunks only: the one chunk straddles block 700, so nothing is released, and it says so.
        doc = self.json("shrink", "kv", "--blocks", "700", "--whole-chunks")
        u = self.proto(doc["reply"], kvd_pb2.PoolUpdate)
        self.assertFalse(u.reshape.target_reached)
        self.assertEqual(u.pool.committed_blocks, 2048)
        self.assertEqual(u.reshape.chunks_replaced, 0)
        human = self.ok("shrink", "kv", "--blocks", "700", "--whole-chunks")
        self.assertRegex(human, r"(?m)^target +NOT reached: 2048 blocks committed for a target of 700 "
                                r"\(--whole-chunks releases whole chunks only\)$")
        # Exact: each segment's chunk is replaced by one of 2 MiB (500 blocks of 4 KiB per segment, rounded up
        # to the granularity: 512).
        human = self.ok("shrink", "kv", "--blocks", "500")
        self.assertRegex(human, r"^shrank kv to 512 blocks \(4\.00 MiB\) in [0-9.]+ ms, 2 chunks released")
        self.assertRegex(human, r"(?m)^target +reached: every segment ends at block 512$")
        self.assertRegex(human, r"(?m)^chunks +2 before, 2 after \(2 replaced, 2 new\)$")
        self.assertRegex(human, r"(?m)^copied +4\.00 MiB on the device in [0-9.]+ ms$")
        # Compaction shrink: live blocks at or above the target move below it, in increasing order; the
        # prefix then ends at 256 blocks rounded up to the granularity (512).
        self.ok("grow", "kv", "--blocks", "2048")
        live = os.path.join(self.dir, "live.txt")
        with open(live, "w") as f:
            f.write("3\n10 400\n450,1999\n")
        doc = self.json("shrink", "kv", "--blocks", "256", "--live-blocks", "@" + live)
        u = self.proto(doc["reply"], kvd_pb2.PoolUpdate)
        self.assertTrue(u.reshape.target_reached)
        self.assertEqual([(m.src, m.dst) for m in u.reshape.moved_blocks], [(400, 0), (450, 1), (1999, 2)])
        self.assertEqual(u.pool.committed_blocks, 512)
        self.assertIn("INVALID_ARGUMENT", self.fails("shrink", "kv", "--blocks", "128", "--live-blocks", "5,5"))
        self.assertIn("--live-blocks", self.fails("shrink", "kv", "--blocks", "128", "--live-blocks", "x"))
        self.assertIn("--live-blocks", self.fails("shrink", "kv", "--blocks", "128", "--live-blocks", "@/nonexistent"))
        self.fails("shrink", "kv", "--blocks", "128", "--live-blocks", "1", "--whole-chunks", code=2)
        human = self.ok("shrink", "kv", "--blocks", "128", "--live-blocks", "")
        self.assertRegex(human, r"(?m)^moved +0 live blocks below the target$")

    def test_help_on_every_verb(self):
        for verb in [["status"], ["pools"], ["describe"], ["create"], ["grow"], ["shrink"], ["compact"], ["sleep"],
                     ["wake"], ["delete"], ["layout"], ["layout", "resolve"], ["grant"], ["revoke"], ["group"],
                     ["group", "status"], ["group", "grow"], ["group", "shrink"], ["group", "sleep"],
                     ["group", "wake"], ["transfer"], ["caps"], ["drain"], ["policy"], ["top"]]:
            r = subprocess.run([KVCTL] + verb + ["--help"], capture_output=True, text=True, timeout=WAIT_S)
            self.assertEqual(r.returncode, 0, verb)
            self.assertIn("Usage", r.stdout, verb)


class KvctlDebugLogTest(KvctlCase):
    """docs/operations.md, "Troubleshooting with kvctl": at --log-level=debug every resize's info line is followed
    by where the daemon's time went."""

    def kvd_args(self):
        return ["--log-level=debug"]

    def phases(self, verb):
        """The phases (name -> seconds) of the last debug line for `verb` ("grew", "shrank", ...) of pool kv."""
        lines = [line for line in self.log().splitlines() if f"{verb} pool kv: admit " in line]
        self.assertTrue(lines, f"no debug line for {verb}: {self.log()}")
        units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
        found = {}
        for part in lines[-1].split(f"{verb} pool kv: ", 1)[1].split(", "):
            name, value = part.split(" ", 1)
            m = re.fullmatch(r"([0-9.]+)(ns|us|ms|s)?", value)
            self.assertIsNotNone(m, f"{name}: {value!r} in {lines[-1]}")
            found[name] = float(m.group(1)) * units[m.group(2) or "s"]
        self.assertEqual(list(found), ["admit", "create", "export", "map", "store", "apply", "save", "release"])
        return found

    def test_every_resize_says_where_its_time_went(self):
        self.ok("create", "kv", *DIMS, "--initial-blocks", "1024")
        self.ok("grow", "kv", "--blocks", "2048")
        grew = self.phases("grew")
        self.assertGreater(grew["create"], 0)
        self.assertGreater(grew["admit"], 0)
        self.assertEqual(grew["map"], 0, "a grow maps nothing into kvd's view (Note [The daemon maps on demand])")
        self.assertEqual(grew["release"], 0)
        self.ok("shrink", "kv", "--blocks", "1024", "--wait")
        shrank = self.phases("shrank")
        self.assertEqual(shrank["create"], 0)
        self.assertGreater(shrank["release"], 0)
        self.ok("sleep", "kv", "--wait")
        self.assertGreater(self.phases("put to sleep")["release"], 0)
        self.ok("wake", "kv")
        self.assertGreater(self.phases("woke")["create"], 0)


class KvctlGroupTest(KvctlCase):
    """kvctl group and grant against two daemons of one "node" (devices 0 and 1 of the host backend)."""

    def setUp(self):
        super().setUp()
        # GPU 1 may commit 8 MiB: 1024 blocks of a rank (4 MiB per segment) fit, 2048 do not.
        self.socket1 = self.start_daemon(1, "--budget=8MiB")
        for rank, socket in enumerate([self.socket, self.socket1]):
            r = subprocess.run([KVCTL, "--socket=" + socket, "--json", "create", f"llama-r{rank}", *DIMS,
                                "--initial-blocks", "256", "--group", "llama", "--rank", str(rank),
                                "--group-size", "2"], capture_output=True, text=True, timeout=WAIT_S)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(json.loads(r.stdout)["group"], {"name": "llama", "rank": rank, "size": 2})

    def group(self, *args):
        return self.json("group", *args[:2], "--socket-dir", self.dir, *args[2:])

    def test_group_operations_move_every_rank(self):
        s = self.group("status", "llama")
        self.assertEqual(s["group"], "llama")
        self.assertEqual(s["size"], 2)
        self.assertTrue(s["consistent"])
        self.assertEqual([r["rank"] for r in s["ranks"]], [0, 1])
        self.assertEqual([r["socket"] for r in s["ranks"]], [self.socket, self.socket1])
        self.assertEqual([r["device_uuid"] for r in s["ranks"]],
                         [self.json("status", socket=x)["reply"]["device_uuid"] for x in (self.socket, self.socket1)])
        pools = [self.proto(r["pool"], kvd_pb2.Pool) for r in s["ranks"]]
        self.assertEqual([(p.name, p.group.rank) for p in pools], [("llama-r0", 0), ("llama-r1", 1)])

        g = self.group("grow", "llama", "--blocks", "1024")
        self.assertEqual(g["operation"], "grow")
        updates = [self.proto(r, kvd_pb2.PoolUpdate) for r in g["ranks"]]
        self.assertEqual([(u.pool.group.rank, u.pool.committed_blocks) for u in updates], [(0, 1024), (1, 1024)])
        self.assertEqual(g["prepared_bytes"], 2 * 4 * MiB)
        for key in ["prepare_us", "commit_us", "round_trip_ms"]:
            self.assertGreaterEqual(g[key], 0)

        g = self.group("sleep", "llama", "--wait")
        self.assertEqual([r["pool"]["state"] for r in g["ranks"]], ["POOL_STATE_SLEEPING"] * 2)
        self.assertEqual(self.json("status")["reply"]["committed_bytes"], "0")
        g = self.group("wake", "llama")
        self.assertEqual([r["pool"]["committed_blocks"] for r in g["ranks"]], ["1024", "1024"])

        human = self.ok("group", "status", "llama", "--sockets", f"{self.socket},{self.socket1}")
        self.assertIn("group llama: 2 ranks, awake, 1024 blocks on every rank", human)
        self.assertIn("rank 1", human)
        human = self.ok("group", "shrink", "llama", "--bytes", "4MiB", "--socket-dir", self.dir)
        self.assertIn("shrank group llama: 2 ranks", human)

    def test_a_rank_that_cannot_grow_changes_no_rank(self):
        line = self.fails("group", "grow", "llama", "--blocks", "2048", "--socket-dir", self.dir)
        self.assertIn("RESOURCE_EXHAUSTED", line)
        self.assertIn("failed on rank 1 (llama-r1 on " + self.socket1, line)
        self.assertIn("no rank changed", line)
        s = self.group("status", "llama")
        self.assertTrue(s["consistent"])
        self.assertEqual([r["pool"]["committed_blocks"] for r in s["ranks"]], ["512", "512"])
        self.assertEqual([r["pool"]["transaction"] for r in s["ranks"]], ["", ""])
        self.assertEqual(self.json("status")["reply"]["committed_bytes"], str(4 * MiB))

    def test_group_failures_are_one_line(self):
        self.assertIn("NOT_FOUND", self.fails("group", "status", "mistral", "--socket-dir", self.dir))
        self.assertIn("--ttl", self.fails("group", "grow", "llama", "--blocks", "9", "--ttl", "soon",
                                          "--socket-dir", self.dir))
        empty = os.path.join(self.dir, "empty")
        os.mkdir(empty)
        self.assertIn("no kvd socket", self.fails("group", "status", "llama", "--socket-dir", empty))
        self.assertIn("socket directory", self.fails("group", "status", "llama", "--socket-dir", empty + "-not"))
        self.fails("group", "grow", "llama", "--socket-dir", self.dir, code=2)
        self.ok("delete", "llama-r1", socket=self.socket1)
        self.assertIn("rank 1 of 2 not found", self.fails("group", "sleep", "llama", "--socket-dir", self.dir))

    def test_device_by_uuid_finds_its_kvd(self):
        uuid1 = self.json("status", socket=self.socket1)["reply"]["device_uuid"]
        env = dict(os.environ, KVD_SOCKET_DIR=self.dir)
        r = self.run_kvctl("--json", "--device=" + uuid1, "status", env=env, use_socket=False)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["socket"], self.socket1)
        r = self.run_kvctl("--device=GPU-0000", "status", env=env, use_socket=False)
        self.assertEqual(r.returncode, 1)
        self.assertEqual(len(r.stderr.splitlines()), 1, r.stderr)
        self.assertIn("--device: NOT_FOUND: device GPU-0000: no kvd serves it", r.stderr)

    def test_grant_and_revoke_peer_access(self):
        peer = self.json("status", socket=self.socket1)["reply"]["device_uuid"]
        self.assertNotEqual(peer, self.json("status")["reply"]["device_uuid"])
        p = self.proto(self.json("grant", "llama-r0", peer), kvd_pb2.Pool)
        self.assertEqual(list(p.peer_devices), [peer])
        self.assertIn("granted * on llama-r0; peer devices now: " + peer + ", *", self.ok("grant", "llama-r0", "*"))
        self.assertIn(peer, self.ok("describe", "llama-r0"))
        p = self.json("revoke", "llama-r0", peer)
        self.assertEqual(p["peer_devices"], ["*"])
        self.assertIn("NOT_FOUND", self.fails("revoke", "llama-r0", peer))
        self.assertIn("device_uuid", self.fails("grant", "llama-r0", "not a uuid"))


class KvctlGroupKeepTest(KvctlCase):
    """kvctl group sleep --keep (docs/operations.md, "The host tier"): every rank keeps its contents in its daemon's
    host tier, or, where a daemon has none, no rank changes."""

    def kvd_args(self):
        return ["--host-tier-bytes=16MiB"]

    def setUp(self):
        super().setUp()
        self.sockets = [self.socket, self.start_daemon(1, "--host-tier-bytes=16MiB"), self.start_daemon(2)]

    def create(self, group, sockets):
        for rank, socket in enumerate(sockets):
            self.json("create", f"{group}-r{rank}", *DIMS, "--initial-blocks", "256", "--group", group, "--rank",
                      str(rank), "--group-size", str(len(sockets)), socket=socket)

    def ranks(self, group):
        return [self.proto(r["pool"], kvd_pb2.Pool)
                for r in self.json("group", "status", group, "--socket-dir", self.dir)["ranks"]]

    def test_every_rank_keeps_its_contents_or_none_sleeps(self):
        self.create("llama", self.sockets[:2])
        committed = [p.committed_bytes for p in self.ranks("llama")]
        self.ok("group", "sleep", "llama", "--keep", "--socket-dir", self.dir)
        pools = self.ranks("llama")
        self.assertEqual([(p.state, p.kept_bytes) for p in pools],
                         [(kvd_pb2.POOL_STATE_SLEEPING, c) for c in committed])
        self.ok("group", "wake", "llama", "--socket-dir", self.dir)
        pools = self.ranks("llama")
        self.assertEqual([(p.state, p.kept_bytes, p.committed_bytes) for p in pools],
                         [(kvd_pb2.POOL_STATE_AWAKE, 0, c) for c in committed])
        # Rank 1's daemon has no host tier: its Prepare fails and the group aborts, every rank awake.
        self.create("mistral", [self.sockets[0], self.sockets[2]])
        line = self.fails("group", "sleep", "mistral", "--keep", "--socket-dir", self.dir)
        self.assertIn("FAILED_PRECONDITION", line)
        self.assertIn("--host-tier-bytes", line)
        self.assertIn("no rank changed", line)
        self.assertEqual([(p.state, p.kept_bytes, p.transaction) for p in self.ranks("mistral")],
                         [(kvd_pb2.POOL_STATE_AWAKE, 0, "")] * 2)


class KvctlArbitrationTest(KvctlCase):
    """kvctl policy, grow --wait, pools, status and top (docs/api.md, "Policy, waiting and reclaim"). Tenants
    are another uid (setpriv) where the test runs as root; those cases skip otherwise."""

    def kvd_args(self):
        return ["--max-priority-per-uid=5", "--max-guaranteed-per-uid=16MiB", "--uid-claim=1001:priority=9"]

    def test_policy_is_set_at_create_changed_and_shown(self):
        p = self.proto(self.json("create", "kv", *DIMS, "--initial-blocks", "64", "--priority", "3",
                                 "--min-bytes", "8MiB", "--on-reclaim-timeout", "shrink"), kvd_pb2.Pool)
        self.assertEqual(p.policy.priority, 3)
        self.assertEqual(p.policy.min_bytes, 8 * MiB)
        self.assertEqual(p.policy.on_reclaim_timeout, kvd_pb2.RECLAIM_ACTION_SHRINK)
        p = self.proto(self.json("policy", "kv", "--priority", "7", "--max-bytes", "24MiB"), kvd_pb2.Pool)
        self.assertEqual((p.policy.priority, p.policy.min_bytes, p.policy.max_bytes), (7, 8 * MiB, 24 * MiB))
        out = self.ok("policy", "kv")
        self.assertIn("kv: priority 7, min 8.00 MiB, max 24.0 MiB, on reclaim timeout shrink", out)
        self.assertIn("reclaim      -", out)
        self.assertIn("PRIO", self.ok("pools"))
        self.assertIn("max none", self.ok("policy", "kv", "--max-bytes", "none"))
        # Every field checked, naming it; nothing changes on a refusal.
        self.assertIn("policy.priority", self.fails("policy", "kv", "--priority", "1001"))
        self.assertIn("policy.on_reclaim_timeout", self.fails("policy", "kv", "--on-reclaim-timeout", "sleep"))
        self.assertIn("policy.min_bytes", self.fails("policy", "kv", "--min-bytes", "1GiB"))
        self.assertIn("policy.reclaim_timeout_ms", self.fails("policy", "kv", "--reclaim-timeout", "11m"))
        self.assertEqual(self.json("policy", "kv")["policy"]["priority"], 7)
        # The record keeps it across a restart.
        self.kvd.terminate()
        self.restart_daemon(0)
        self.assertEqual(self.json("policy", "kv")["policy"]["priority"], 7)

    def test_a_cap_refuses_a_grow_at_once(self):
        self.json("create", "kv", *DIMS, "--max-bytes", "8MiB")
        self.assertIn("policy.max_bytes", self.fails("grow", "kv", "--bytes", "16MiB", "--wait"))

    def test_a_waiting_grow_fails_at_its_deadline_saying_what_it_waited_for(self):
        # Budget 512 MiB: "big" (priority 9, an operator's) takes 500 of it; "small" waits for 16.
        self.json("create", "big", *DIMS[:2], "--capacity-blocks", "65536", *DIMS[4:], "--priority", "9")
        self.ok("grow", "big", "--bytes", "500MiB")
        self.json("create", "small", *DIMS)
        self.assertIn("of the daemon's budget", self.fails("grow", "small", "--bytes", "15MiB"))
        line = self.fails("grow", "small", "--bytes", "15MiB", "--wait-for", "1s")
        self.assertIn("RESOURCE_EXHAUSTED", line)
        self.assertIn("waited", line)
        self.assertIn("no pool of lower priority held more than its policy.min_bytes", line)
        d = self.proto(self.json("status")["reply"], kvd_pb2.DeviceInfo)
        self.assertEqual(d.waiting_requests, 0)
        self.assertEqual(d.headroom_bytes, 10 * MiB)  # 1% of 1 GiB, rounded down to the 2 MiB granularity
        out = self.ok("status")
        self.assertIn("admission", out)
        self.assertIn("waiting      0 grows or wakes", out)

    def test_top_shows_the_device_and_every_pools_claim(self):
        self.json("create", "kv", *DIMS, "--initial-blocks", "64", "--priority", "2")
        out = self.ok("top", "--count", "2", "--interval", "10ms")
        self.assertEqual(out.count("available to a grow"), 2, out)
        self.assertIn("PRIO", out)
        self.assertIn("kv", out)

    def tenant(self, uid, *args):
        if os.geteuid() != 0:
            self.skipTest("needs root: the tenant is another uid (setpriv)")
        os.chmod(self.dir, 0o755)
        for path in (self.socket, self.socket[:-5] + ".handles"):
            os.chmod(path, 0o666)
        argv = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", KVCTL,
                "--socket=" + self.socket, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S)

    def test_a_tenant_lowers_its_claim_and_raises_it_only_within_its_grant(self):
        r = self.tenant(1000, "create", "t", *DIMS, "--priority", "6")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("PERMISSION_DENIED: policy.priority: uid 1000 may give the pools of uid 1000 at most priority 5",
                      r.stderr)
        big = [*DIMS[:2], "--capacity-blocks", "8192", *DIMS[4:]]  # 64 MiB: room for more than its grant
        self.assertEqual(self.tenant(1000, "create", "t", *big, "--priority", "5", "--min-bytes", "16MiB").returncode,
                         0)
        r = self.tenant(1000, "policy", "t", "--min-bytes", "17MiB")
        self.assertIn("PERMISSION_DENIED: policy.min_bytes", r.stderr)
        self.assertEqual(self.tenant(1000, "policy", "t", "--priority", "1", "--min-bytes", "0").returncode, 0)
        # --uid-claim replaces the per-uid grant for its uid.
        self.assertEqual(self.tenant(1001, "create", "u", *DIMS, "--priority", "9").returncode, 0)
        self.assertIn("policy.min_bytes", self.tenant(1001, "policy", "u", "--min-bytes", "2MiB").stderr)
        # An operator caps the tenant's pool: the tenant may tighten the cap, not loosen it.
        p = self.proto(self.json("policy", "t", "--max-bytes", "8MiB", "--priority", "40"), kvd_pb2.Pool)
        self.assertTrue(p.policy_operator_bounds)
        self.assertIn("PERMISSION_DENIED: policy.max_bytes", self.tenant(1000, "policy", "t", "--max-bytes", "none").stderr)
        self.assertEqual(self.tenant(1000, "policy", "t", "--max-bytes", "4MiB").returncode, 0)
        self.assertEqual(self.tenant(1000, "policy", "t", "--priority", "30").returncode, 0, "lowering is allowed")
        self.assertIn("policy.priority", self.tenant(1000, "policy", "t", "--priority", "31").stderr)
        self.assertEqual(self.json("policy", "t")["policy"]["max_bytes"], str(4 * MiB))
        # Bound by the operator, the reclaim timeout is --reclaim-timeout's (5 s) until set: longer loosens it.
        self.assertIn("PERMISSION_DENIED: policy.reclaim_timeout_ms: 5000: an operator set it on pool t",
                      self.tenant(1000, "policy", "t", "--reclaim-timeout", "10s").stderr)
        self.assertEqual(self.tenant(1000, "policy", "t", "--reclaim-timeout", "1s").returncode, 0)
        self.assertEqual(self.json("policy", "t")["policy"]["reclaim_timeout_ms"], "1000")

    def test_a_tenants_waiting_grow_names_the_pools_of_others_by_their_uid(self):
        self.json("create", "big", *DIMS[:2], "--capacity-blocks", "65536", *DIMS[4:])  # an operator's, priority 0
        self.ok("grow", "big", "--bytes", "500MiB")
        self.assertEqual(self.tenant(1000, "create", "t", *DIMS, "--priority", "5").returncode, 0)
        r = self.tenant(1000, "grow", "t", "--bytes", "15MiB", "--wait-for", "2s")
        self.assertIn("RESOURCE_EXHAUSTED", r.stderr)
        self.assertIn(f"a pool of uid {os.geteuid()} (priority 0) was asked for 4.00 MiB: no client attached to "
                      "answer; its policy does nothing more", r.stderr)
        self.assertNotIn("big", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
