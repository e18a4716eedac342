"""Helpers the Python tests share: waiting for a condition, counting chunk FDs, and scraping a kvd's /metrics."""
import os
import re
import socket
import time
import urllib.request


def poll(fn, what, timeout=30.0):
    """fn()'s first truthy value, tried every 10 ms; AssertionError naming `what` (a string, or a callable
    that says it) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        time.sleep(0.01)


def memfd_fds():
    """Open FDs of chunks (memfds) in this process; gRPC's own FDs vary by version and are not counted."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def parse_samples(text):
    """{(name, frozenset(labels.items())): value} from the Prometheus text format (escapes kept as is)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        labels = {}
        name = series
        if "{" in series:
            name, rest = series.split("{", 1)
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        samples[(name, frozenset(labels.items()))] = float(value)
    return samples
