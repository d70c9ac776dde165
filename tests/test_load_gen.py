"""The load generator against a real HTTP server on loopback that fails on purpose for a while."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.loopback_http import serving
from workloads import load_gen


class FlakyHandler(BaseHTTPRequestHandler):
    failing = threading.Event()

    def do_POST(self):  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = (503, b"down") if self.failing.is_set() else (200, json.dumps({"class": 1}).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """Function scope; an HTTP server on 127.0.0.1, shut down at teardown."""
    with serving(FlakyHandler) as srv:
        yield f"http://127.0.0.1:{srv.server_address[1]}/"
    FlakyHandler.failing.clear()


def test_counts_every_request_and_reports_availability(server, capsys):
    timer = threading.Timer(1.0, FlakyHandler.failing.set)
    timer.start()
    summary = load_gen.run([server], rate=20, duration=2, concurrency=4, timeout_s=1)
    timer.cancel()
    assert summary["sent"] == 40
    assert summary["ok"] + summary["failed"] == 40
    assert 10 <= summary["ok"] <= 30, summary  # about the first second succeeded
    assert summary["availability"] == pytest.approx(summary["ok"] / 40)
    assert "HTTP Error 503" in " ".join(summary["errors"])
    lines = [json.loads(ln.split(" ", 1)[1]) for ln in capsys.readouterr().out.splitlines() if ln.startswith("RAYPROOF")]
    per_second = [ln for ln in lines if ln["event"] == "second"]
    assert [s["second"] for s in per_second] == [0, 1]
    assert sum(s["ok"] + s["fail"] for s in per_second) == 40


def test_unreachable_target_fails_fast_and_is_bounded():
    summary = load_gen.run(["http://127.0.0.1:9/"], rate=10, duration=1, concurrency=2, timeout_s=0.5)
    assert summary["ok"] == 0 and summary["failed"] == 10 and summary["availability"] == 0


def test_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        load_gen.main(["--target", "http://x/", "--rate", "0"])


def test_sigterm_stops_it_early_with_the_seconds_begun_and_a_summary(server):
    """A caller keeps load on until its event is over, then stops it: the summary still comes."""
    repo = Path(load_gen.__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "workloads.load_gen", "--target", server, "--rate", "10",
                             "--duration", "60", "--timeout", "1"], cwd=repo, stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # blocks until the first second is reported (about 3 s in)
    assert '"event": "second"' in first
    proc.terminate()
    out = first + proc.communicate(timeout=10)[0]
    events = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("RAYPROOF")]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["stopped_early"]
    assert 1 <= summary["duration_s"] < 60 and summary["sent"] <= 10 * summary["duration_s"]
    assert [e["second"] for e in events if e["event"] == "second"] == list(range(summary["duration_s"]))
    assert proc.returncode == 0
