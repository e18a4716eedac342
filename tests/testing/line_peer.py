"""A helper process a test drives over its stdin and stdout: one JSON object a line each way. The test
writes {"op": ..., ...}; the helper answers {"ok": true, "result": ...} or {"ok": false, "error": ...}.
Used by the Python package's tests and the reshape test for their client processes."""
import json
import subprocess


class LinePeer:
    def __init__(self, argv, name, env=None):
        self.name = name
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def _reply(self):
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"{self.name} died (exit {self.p.wait()})")
        r = json.loads(line)
        if not r["ok"]:
            raise AssertionError(f"{self.name}: {r['error']}")
        return r.get("result")

    def __call__(self, op, **kw):
        kw["op"] = op
        self.p.stdin.write(json.dumps(kw) + "\n")
        self.p.stdin.flush()
        return self._reply()

    def close(self, timeout=30):
        if self.p.poll() is None and not self.p.stdin.closed:
            try:
                self("exit")
            except Exception:
                pass
            try:
                self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
