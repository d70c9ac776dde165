"""The Ray nodes a GCS lists as alive, once a second, from a pod in the team's namespace.

GCS-1's observer: it polls Ray's state API (``/api/v0/nodes`` on the head's
dashboard, answered from the GCS) as any client in the namespace would, so it
needs nothing beyond creating a pod and reading its log (no API-server proxy).
Each second it prints one ``RAYPROOF_EVENT`` line: ``ray_nodes`` with the
sample's time and either ``alive`` (count), ``dead`` and ``alive_nodes``
(``head:``/``worker:`` and the first 12 characters of each node id), or
``error`` when the GCS did not answer. It stops after ``seconds``.

Usage: ``python ray_nodes_observer.py URL SECONDS``.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request

ANSWER_S = 4  # one request's own limit, within the one-second pace


def sample(url: str) -> dict:
    rec: dict = {"event": "ray_nodes", "ts": round(time.time(), 2)}
    try:
        with urllib.request.urlopen(url, timeout=ANSWER_S) as response:
            nodes = json.load(response)["data"]["result"]["result"]
        alive = [n for n in nodes if n["state"] == "ALIVE"]
        rec.update(alive=len(alive), dead=len(nodes) - len(alive), alive_nodes=sorted(
            ("head:" if n.get("is_head_node") else "worker:") + n["node_id"][:12] for n in alive))
    except Exception as exc:  # noqa: BLE001 -- any failure to answer is what the sample records
        rec["error"] = f"{type(exc).__name__}: {exc}"[:160]
    return rec


def main(argv: list[str]) -> int:
    url, until = argv[0], time.time() + float(argv[1])
    while time.time() < until:
        began = time.time()
        print("RAYPROOF_EVENT " + json.dumps(sample(url)), flush=True)
        time.sleep(max(0.0, 1 - (time.time() - began)))  # sleep-ok: the observer's own pacing, in the pod
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
