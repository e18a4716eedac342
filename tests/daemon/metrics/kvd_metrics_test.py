#!/usr/bin/env python3
"""kvd's /metrics end to end: the real kvd (host backend) with --metrics-address, driven by kvctl.

MetricsScrapeTest: scrapes /metrics, runs `promtool check metrics` on it and checks values against
`kvctl --json describe` (proto3 JSON: 64-bit integers are strings). PrometheusServerTest: a real Prometheus server (own config, data dir and
port) scrapes kvd every second; the grown value is read back through its HTTP query API.

$KVD_BINARY, $KVCTL_BINARY name the binaries (ctest sets both); $PROMTOOL / $PROMETHEUS default to
the ones on PATH. Without promtool / prometheus the test exits 77 (ctest reports it as skipped).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "testing"))
from kvd_daemon import KvdDaemonCase  # noqa: E402
from scrape import free_port, http_get, parse_samples  # noqa: E402
import urllib.parse

KVD = os.environ.get("KVD_BINARY", "kvd")
KVCTL = os.environ.get("KVCTL_BINARY", "kvctl")
KVD_PROBE = os.environ.get("KVD_PROBE_BINARY", "kvd_probe")
PROMTOOL = os.environ.get("PROMTOOL") or shutil.which("promtool")
PROMETHEUS = os.environ.get("PROMETHEUS") or shutil.which("prometheus")
WAIT_S = 30
SKIP = 77
MiB = 1 << 20

# 2 layers x 2 heads x 16 tokens x 64 channels x 2 bytes: 8 KiB per block.
DIMS = ["--layers", "2", "--capacity-blocks", "4096", "--heads", "2", "--block-tokens", "16", "--channels", "64",
        "--element-bytes", "2"]








def L(*pairs, device="0"):
    """The label set of a kvd series: `pairs` plus the device every kvd_ series carries."""
    return frozenset(pairs) | {("device", device)}


class KvdFixture(KvdDaemonCase):
    def kvd_args(self):
        self.metrics_port = free_port()
        # Per-client series (pid, uid, name) only where a test asks for them: they are off by default.
        clients = ["--metrics-clients"] if self._testMethodName.startswith("test_attached_client_has_series") else []
        return [f"--metrics-address=127.0.0.1:{self.metrics_port}"] + clients

    def kvctl_json(self, *args):
        r = subprocess.run([KVCTL, "--socket=" + self.socket, "--json"] + list(args), capture_output=True, text=True,
                           timeout=WAIT_S)
        self.assertEqual(r.returncode, 0, f"kvctl {' '.join(args)}: {r.stderr}")
        return json.loads(r.stdout)

    def scrape(self):
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")


class LimitsMetricsTest(KvdFixture):
    """kvd_limit, kvd_tenant_* and kvd_limit_refusals_total (docs/metrics.md, "Limits")."""

    def kvd_args(self):
        if self._testMethodName == "test_control_connections_and_their_refusals":
            return super().kvd_args() + ["--max-control-connections=2"]
        return super().kvd_args() + ["--max-pools=2"]

    def test_limits_usage_and_refusals(self):
        self.kvctl_json("create", "a", *DIMS)
        self.kvctl_json("create", "b", *DIMS)
        r = subprocess.run([KVCTL, "--socket=" + self.socket, "create", "c"] + DIMS, capture_output=True, text=True,
                           timeout=WAIT_S)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("RESOURCE_EXHAUSTED: pools of all uids: 2 of 2 for uid 0 (--max-pools)", r.stderr)
        d = self.kvctl_json("describe", "a")
        text = self.scrape()
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=WAIT_S)
        self.assertEqual(check.returncode, 0, "promtool check metrics:\n" + check.stdout + check.stderr + text)
        s = parse_samples(text)
        uid = str(os.getuid())
        self.assertEqual(s[("kvd_limit", L(("limit", "max-pools")))], 2)
        self.assertEqual(s[("kvd_limit", L(("limit", "max-pools-per-uid")))], 256)
        self.assertEqual(s[("kvd_limit", L(("limit", "max-request-bytes")))], 4 * MiB)
        self.assertEqual(s[("kvd_limit", L(("limit", "operator-reserve")))], 5)
        self.assertEqual(s[("kvd_tenant_pools", L(("uid", uid)))], 2)
        self.assertEqual(s[("kvd_tenant_reserved_bytes", L(("uid", uid)))], 2 * int(d["reserved_bytes"]))
        self.assertEqual(s[("kvd_limit_refusals_total", L(("limit", "max-pools")))], 1)
        self.assertEqual(s[("kvd_limit_refusals_total", L(("limit", "max-sessions-per-uid")))], 0)
        self.assertEqual(s[("kvd_limit", L(("limit", "max-control-connections")))], 1024)
        self.assertEqual(s[("kvd_limit", L(("limit", "max-control-connections-per-uid")))], 256)
        self.assertEqual(s[("kvd_limit_refusals_total", L(("limit", "max-control-connections")))], 0)
        self.assertEqual(s[("kvd_limit_refusals_total", L(("limit", "max-control-connections-per-uid")))], 0)
        self.assertEqual(len([k for k in s if k[0] == "kvd_limit_refusals_total"]), 12)
        self.kvctl_json("delete", "b")
        s = parse_samples(self.scrape())
        self.assertEqual(s[("kvd_tenant_pools", L(("uid", uid)))], 1)

    def test_control_connections_and_their_refusals(self):
        """kvd_tenant_control_connections counts open control-socket connections; a refused one is counted."""

        def connect():
            # A raw connection: admitted when gRPC's server preface (SETTINGS) arrives, refused at EOF.
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(self.socket)
            s.settimeout(WAIT_S)
            try:
                admitted = len(s.recv(256)) > 0
            except ConnectionResetError:
                admitted = False
            return s, admitted

        uid = str(os.getuid())
        first, ok1 = connect()
        second, ok2 = connect()
        third, ok3 = connect()
        self.assertEqual((ok1, ok2, ok3), (True, True, False))
        s = parse_samples(self.scrape())
        self.assertEqual(s[("kvd_limit", L(("limit", "max-control-connections")))], 2)
        self.assertEqual(s[("kvd_tenant_control_connections", L(("uid", uid)))], 2)
        self.assertEqual(s[("kvd_limit_refusals_total", L(("limit", "max-control-connections")))], 1)
        self.assertIn("control socket: refused a connection: control-socket connections of all uids: 2 of 2 for uid "
                      f"{uid} (--max-control-connections)", self.log())
        for c in (first, second, third):
            c.close()
        # gRPC closes its side once it reads the EOF; the series goes with the last connection.
        deadline = time.monotonic() + WAIT_S
        while ("kvd_tenant_control_connections", L(("uid", uid))) in parse_samples(self.scrape()):
            self.assertLess(time.monotonic(), deadline, "the closed connections still count")
            time.sleep(0.05)


class MetricsScrapeTest(KvdFixture):
    def test_scrape_passes_promtool_and_matches_kvctl(self):
        self.kvctl_json("create", "kv", *DIMS, "--initial-blocks", "1024")
        self.kvctl_json("grow", "kv", "--bytes", "32MiB")
        self.kvctl_json("create", "gone", *DIMS, "--initial-blocks", "256")
        self.kvctl_json("delete", "gone")
        self.kvctl_json("create", "rank1", *DIMS, "--group", "llama", "--rank", "1", "--group-size", "2")
        d = self.kvctl_json("describe", "kv")
        status = self.kvctl_json("status")["reply"]  # kvd.v1.DeviceInfo

        text = self.scrape()
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=WAIT_S)
        self.assertEqual(check.returncode, 0, "promtool check metrics:\n" + check.stdout + check.stderr + text)

        s = parse_samples(text)
        pool = L(("pool", "kv"))
        self.assertEqual(s[("kvd_pool_committed_bytes", pool)], int(d["committed_bytes"]))
        self.assertEqual(s[("kvd_pool_committed_bytes", pool)], 32 * MiB)
        self.assertEqual(s[("kvd_pool_reserved_bytes", pool)], int(d["reserved_bytes"]))
        self.assertEqual(s[("kvd_pool_committed_blocks", pool)], int(d["committed_blocks"]))
        self.assertEqual(s[("kvd_pool_capacity_blocks", pool)], 4096)
        self.assertEqual(s[("kvd_pool_pending_release_bytes", pool)], 0)
        self.assertEqual(s[("kvd_pool_attached_clients", pool)], 0)
        self.assertEqual(s[("kvd_pool_state", L(("pool", "kv"), ("state", "awake")))], 1)
        self.assertEqual(s[("kvd_pool_state", L(("pool", "kv"), ("state", "sleeping")))], 0)
        self.assertEqual(s[("kvd_pool_held", pool)], 0)
        self.assertEqual([k for k in s if k[0] == "kvd_pool_group_info"],
                         [("kvd_pool_group_info", L(("pool", "rank1"), ("group", "llama"), ("rank", "1"), ("size", "2")))])
        # A deleted pool leaves no series behind.
        self.assertFalse([k for k in s if ("pool", "gone") in k[1]], text)

        dev = L(("backend", "host"), ("uuid", status["device_uuid"]))
        self.assertTrue(status["device_uuid"].startswith("host-") and status["device_uuid"].endswith("-0"), status)
        self.assertEqual(s[("kvd_device_budget_bytes", dev)], 512 * MiB)
        self.assertEqual(s[("kvd_device_total_bytes", dev)], int(status["total_bytes"]))
        self.assertEqual(s[("kvd_device_committed_bytes", dev)], int(status["committed_bytes"]))
        self.assertIn(("kvd_device_free_bytes", dev), s)
        self.assertEqual([v for k, v in s.items() if k[0] == "kvd_build_info"], [1])
        build = [dict(k[1]) for k in s if k[0] == "kvd_build_info"][0]
        self.assertEqual((build["device"], build["uuid"], build["backend"]), ("0", status["device_uuid"], "host"))
        # Every kvd series names its device, so several kvds of one node stay apart without the port.
        self.assertEqual([k for k in s if k[0].startswith("kvd_") and ("device", "0") not in k[1]], [])

        self.assertEqual(s[("kvd_operations_total", L(("op", "grow"), ("result", "ok")))], 1)
        self.assertEqual(s[("kvd_operation_duration_seconds_count", L(("op", "grow")))], 1)
        self.assertEqual(s[("kvd_rpc_requests_total", L(("method", "Grow"), ("code", "OK")))], 1)
        self.assertEqual(s[("kvd_rpc_requests_total", L(("method", "CreatePool"), ("code", "OK")))], 3)

        # A failed RPC is counted by its code; sleep and wake are timed.
        r = subprocess.run([KVCTL, "--socket=" + self.socket, "grow", "missing", "--blocks", "1"],
                           capture_output=True, text=True, timeout=WAIT_S)
        self.assertNotEqual(r.returncode, 0)
        self.kvctl_json("sleep", "kv")
        s = parse_samples(self.scrape())
        self.assertGreaterEqual(
            s[("kvd_rpc_requests_total", L(("method", "Grow"), ("code", "NOT_FOUND")))], 1)
        self.assertEqual(s[("kvd_pool_state", L(("pool", "kv"), ("state", "sleeping")))], 1)
        self.assertEqual(s[("kvd_operations_total", L(("op", "sleep"), ("result", "ok")))], 1)
        self.kvctl_json("wake", "kv")
        s = parse_samples(self.scrape())
        self.assertEqual(s[("kvd_operations_total", L(("op", "wake"), ("result", "ok")))], 1)
        self.assertEqual(s[("kvd_pool_state", L(("pool", "kv"), ("state", "awake")))], 1)

    def test_attached_client_has_series_with_its_pid_and_uid(self):
        self.kvctl_json("create", "kv", *DIMS, "--initial-blocks", "1024")
        holder = subprocess.Popen([KVD_PROBE, "--socket=" + self.socket, "attach", "kv", "--wait-for=9"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                s = parse_samples(self.scrape())
                if s.get(("kvd_pool_attached_clients", L(("pool", "kv")))) == 1:
                    break
                self.assertIsNone(holder.poll(), "kvd_probe attach exited early")
                self.assertLess(time.monotonic(), deadline, "the probe never attached")
                time.sleep(0.05)
            mapped = {dict(k[1])["pid"]: (dict(k[1]), v) for k, v in s.items() if k[0] == "kvd_client_mapped_bytes"}
            self.assertIn(str(holder.pid), mapped, mapped)
            labels, value = mapped[str(holder.pid)]
            self.assertEqual(labels["pool"], "kv")
            self.assertEqual(labels["uid"], str(os.getuid()))
            self.assertTrue(labels["client"])
            self.assertEqual(value, int(self.kvctl_json("describe", "kv")["committed_bytes"]))
            self.assertEqual(s[("kvd_operations_total", L(("op", "attach"), ("result", "ok")))], 1)
            r = subprocess.run([KVD_PROBE, "--socket=" + self.socket, "attach", "kv", "--write=9"],
                               capture_output=True, text=True, timeout=WAIT_S)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertEqual(holder.wait(WAIT_S), 0)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()

    def test_client_pids_uids_and_names_are_not_served_by_default(self):
        self.kvctl_json("create", "kv", *DIMS, "--initial-blocks", "1024")
        holder = subprocess.Popen([KVD_PROBE, "--socket=" + self.socket, "attach", "kv", "--wait-for=9"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                s = parse_samples(self.scrape())
                if s.get(("kvd_pool_attached_clients", L(("pool", "kv")))) == 1:
                    break
                self.assertIsNone(holder.poll(), "kvd_probe attach exited early")
                self.assertLess(time.monotonic(), deadline, "the probe never attached")
                time.sleep(0.05)
            self.assertEqual([k for k in s if k[0] == "kvd_client_mapped_bytes"], [])
            text = self.scrape()
            self.assertNotIn(f'pid="{holder.pid}"', text)
            r = subprocess.run([KVD_PROBE, "--socket=" + self.socket, "attach", "kv", "--write=9"],
                               capture_output=True, text=True, timeout=WAIT_S)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertEqual(holder.wait(WAIT_S), 0)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()

    def test_the_kvd_of_another_device_labels_every_series_with_it(self):
        port = free_port()
        second = os.path.join(self.dir, "second")
        os.mkdir(second, 0o750)
        with open(os.path.join(second, "kvd.log"), "wb") as log:
            kvd = subprocess.Popen([KVD, "--backend=host", "--device=1", "--socket=" + os.path.join(second, "gpu1.sock"),
                                    "--host-capacity=1GiB", f"--metrics-address=127.0.0.1:{port}"],
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    text = http_get(f"http://127.0.0.1:{port}/metrics")
                    break
                except OSError:
                    self.assertIsNone(kvd.poll(), "the second kvd exited")
                    self.assertLess(time.monotonic(), deadline, "the second kvd never served /metrics")
                    time.sleep(0.05)
            ours, theirs = parse_samples(self.scrape()), parse_samples(text)
            kvd_series = [k for k in theirs if k[0].startswith("kvd_")]
            self.assertTrue(kvd_series)
            self.assertEqual([k for k in kvd_series if ("device", "1") not in k[1]], [], text)
            uuids = {dict(k[1])["uuid"] for k in kvd_series if "uuid" in dict(k[1])}
            self.assertEqual(len(uuids), 1, uuids)
            self.assertTrue(uuids.pop().endswith("-1"))
            # Both kvds' series together: none collides, as in one Prometheus without the instance label.
            self.assertFalse(set(kvd_series) & set(k for k in ours if k[0].startswith("kvd_")))
        finally:
            kvd.send_signal(signal.SIGTERM)
            kvd.wait(WAIT_S)

    def test_taken_metrics_address_refuses_to_start(self):
        r = subprocess.run([KVD, "--backend=host", "--socket=" + os.path.join(self.dir, "gpu1.sock"),
                            "--host-capacity=1GiB", f"--metrics-address=127.0.0.1:{self.metrics_port}"],
                           capture_output=True, text=True, timeout=WAIT_S)
        self.assertNotEqual(r.returncode, 0)
        errors = [line for line in (r.stdout + r.stderr).splitlines() if " error " in line]
        self.assertEqual(len(errors), 1, r.stdout + r.stderr)
        self.assertIn("--metrics-address", errors[0])


class PrometheusServerTest(KvdFixture):
    def setUp(self):
        super().setUp()
        self.prom_port = free_port()
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvd
    scrape_interval: 1s
    scrape_timeout: 1s
    static_configs:
      - targets: ['127.0.0.1:{self.metrics_port}']
""")
        self.prom_log_path = os.path.join(self.dir, "prometheus.log")
        with open(self.prom_log_path, "wb") as log:
            self.prom = subprocess.Popen([PROMETHEUS, "--config.file=" + config,
                                          "--storage.tsdb.path=" + os.path.join(self.dir, "data"),
                                          f"--web.listen-address=127.0.0.1:{self.prom_port}"],
                                         stdout=log, stderr=subprocess.STDOUT)

    def tearDown(self):
        self.prom.send_signal(signal.SIGTERM)
        try:
            self.prom.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.prom.kill()
            self.prom.wait()
        super().tearDown()

    def prom_log(self):
        with open(self.prom_log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def api(self, path, **params):
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        return json.loads(http_get(url))

    def wait_for(self, what, probe):
        deadline = time.monotonic() + WAIT_S
        last = None
        while time.monotonic() < deadline:
            self.assertIsNone(self.prom.poll(), "prometheus exited: " + self.prom_log())
            try:
                last = probe()
                if last is not None:
                    return last
            except OSError as e:  # not listening yet
                last = e
            time.sleep(0.25)
        self.fail(f"{what} within {WAIT_S}s (last: {last}); prometheus log:\n{self.prom_log()}")

    def test_prometheus_scrapes_grown_pool(self):
        def target_up():
            targets = self.api("targets")["data"]["activeTargets"]
            return True if any(t["health"] == "up" for t in targets) else None

        self.wait_for("kvd target up", target_up)
        self.kvctl_json("create", "kv", *DIMS, "--initial-blocks", "1024")
        grown = self.kvctl_json("grow", "kv", "--bytes", "24MiB")
        expected = int(self.kvctl_json("describe", "kv")["committed_bytes"])
        self.assertEqual(expected, 24 * MiB, grown)

        def grown_value():
            r = self.api("query", query='kvd_pool_committed_bytes{pool="kv"}')
            result = r["data"]["result"]
            if result and float(result[0]["value"][1]) == expected:
                return result
            return None

        result = self.wait_for(f"kvd_pool_committed_bytes{{pool=\"kv\"}} == {expected}", grown_value)
        self.assertEqual(len(result), 1)
        self.assertEqual(result[0]["metric"]["job"], "kvd")
        self.assertEqual(result[0]["metric"]["device"], "0")


if __name__ == "__main__":
    needed = {"MetricsScrapeTest": PROMTOOL, "PrometheusServerTest": PROMETHEUS}
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    for name in names or needed:
        if not needed.get(name.split(".")[0], True):
            print(f"SKIPPED: {name} needs {'promtool' if 'Scrape' in name else 'prometheus'} (apt-get install "
                  "prometheus; deploy/quickstart.sh installs it)")
            sys.exit(SKIP)
    unittest.main(verbosity=2)
