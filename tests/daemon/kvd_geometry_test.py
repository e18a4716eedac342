"""kvd-geometry end to end: the real program, its JSON checked against the v1 API's Python messages."""
import json
import os
import subprocess
import sys
import unittest

from google.protobuf import json_format

from kvd.v1 import kvd_pb2

PROGRAM = os.environ["KVD_GEOMETRY"]


def run(*args, env=None):
    return subprocess.run([PROGRAM, *args], capture_output=True, text=True, env=env, timeout=60)


class KvdGeometryTest(unittest.TestCase):
    def test_json_is_the_v1_messages_and_the_chain_decides(self):
        out = run("--json", "-L", "4", "-B", "10", "-H", "2", "-N", "16", "-C", "64", "-e", "2",
                  "--require", "FLASHINFER=block-outermost", "--connector", "nixl=BHLNC",
                  env={"KVD_KV_CACHE_LAYOUT": "LBNHC", "PATH": os.environ.get("PATH", "")})
        self.assertEqual(out.returncode, 0, out.stderr)
        doc = json.loads(out.stdout)
        resolution = json_format.ParseDict(doc["resolution"], kvd_pb2.LayoutResolution())
        self.assertEqual(resolution.layout, "BHLNC")
        self.assertEqual(resolution.rule, kvd_pb2.LAYOUT_RULE_CONNECTOR_PREFERENCE)
        self.assertEqual(list(resolution.allowed_layouts), ["BLHNC", "BLNHC", "BHLNC"])
        self.assertTrue(any("KVD_KV_CACHE_LAYOUT=LBNHC" in w for w in resolution.warnings), resolution.warnings)
        geometries = {g["layout"]: json_format.ParseDict(g, kvd_pb2.Geometry()) for g in doc["geometries"]}
        self.assertEqual(sorted(geometries), sorted(["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]))
        lhbnc = geometries["LHBNC"]
        self.assertEqual((lhbnc.stride_c, lhbnc.stride_n, lhbnc.stride_b), (2, 128, 2048))
        self.assertEqual(lhbnc.segments, 8)
        self.assertEqual(lhbnc.segment_stride, 2 << 20)  # 10 * 2048 bytes padded to 2 MiB
        self.assertEqual(lhbnc.stride_h, 2 << 20)
        self.assertEqual(lhbnc.stride_l, 4 << 20)
        self.assertEqual(lhbnc.reserved_bytes, 8 * (2 << 20))

    def test_human_output_marks_the_winner(self):
        out = run("--override", "blhnc")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("layout   BLHNC, by request override", out.stdout)
        marked = [line for line in out.stdout.splitlines() if line.startswith("* ")]
        self.assertEqual(len(marked), 1)
        self.assertIn("BLHNC", marked[0])

    def test_bad_input_is_one_line_naming_the_field(self):
        cases = [
            (["--override", "LBXNC"], "layout_request.override_layout"),
            (["--require", "A=LBHNC", "--require", "B=BLHNC"], "no layout satisfies both"),
            (["--heads", "0"], "dims.heads: must be > 0"),
            (["--granularity", "3MiB"], "granularity: 3145728 is not a power of two"),
            (["--granularity", "lots"], "--granularity"),
        ]
        for args, want in cases:
            with self.subTest(args=args):
                out = run(*args)
                self.assertEqual(out.returncode, 1, out.stdout)
                self.assertEqual(out.stderr.count("\n"), 1, out.stderr)
                self.assertTrue(out.stderr.startswith("kvd-geometry: "), out.stderr)
                self.assertIn(want, out.stderr)

    def test_help(self):
        out = run("--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("--require", out.stdout)
        self.assertIn("precedence chain", out.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
