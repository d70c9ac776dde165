"""GCS-1's Ray-nodes observer against a real HTTP server on loopback answering as Ray's state API does."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from core.events import parse_events
from tests.loopback_http import serving

PROGRAM = Path(__file__).resolve().parents[1] / "workloads" / "ray_nodes_observer.py"
NODES = [{"node_id": "a" * 40, "state": "ALIVE", "is_head_node": True},
         {"node_id": "b" * 40, "state": "ALIVE", "is_head_node": False},
         {"node_id": "c" * 40, "state": "DEAD", "is_head_node": False}]


class StateApi(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server API
        body = json.dumps({"data": {"result": {"result": NODES}}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def observe(url: str, seconds: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(PROGRAM), url, seconds], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [e for e in parse_events(proc.stdout) if e["event"] == "ray_nodes"]


def test_the_observer_logs_the_alive_nodes_each_second():
    with serving(StateApi) as server:
        samples = observe(f"http://127.0.0.1:{server.server_address[1]}/api/v0/nodes", "1.5")
    assert len(samples) == 2, samples  # one a second, for as long as it was asked
    assert samples[0]["alive"] == 2 and samples[0]["dead"] == 1
    assert samples[0]["alive_nodes"] == ["head:" + "a" * 12, "worker:" + "b" * 12]


def test_a_gcs_that_does_not_answer_is_a_sample_with_its_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    samples = observe(f"http://127.0.0.1:{port}/api/v0/nodes", "0.5")
    assert samples and "alive" not in samples[0] and "Connection refused" in samples[0]["error"], samples
