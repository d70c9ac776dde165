"""Run the node agent as a process, or clean up after one.

    python -m clusters.embedded.nodeagent [run] --kubeconfig K --state-dir D [--nodes N]
        [--profile P] [--pki-dir DIR] [--pod-network-dir DIR --platform NAME]
    python -m clusters.embedded.nodeagent down --state-dir D [--pod-network-dir DIR --platform NAME]

``run`` serves until SIGTERM or SIGINT, then stops every container and
removes everything it made (well within the platform supervisor's grace
period: containers get SIGTERM and 2 s, as a kubelet's minimum). ``down``
removes what a killed agent left behind, from its state directory's records.
The pod network is :class:`clusters.embedded.podnet.PodNetwork` with its
state in ``--pod-network-dir`` (the platform's ``<run_dir>/podnet``).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def _podnet(args: argparse.Namespace) -> Any:
    if not args.pod_network_dir:
        return None
    from clusters.embedded.podnet import PodNetwork

    return PodNetwork(args.platform, args.pod_network_dir).open()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "down"):
        argv.insert(0, "run")
    parser = argparse.ArgumentParser(prog="python -m clusters.embedded.nodeagent")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="register the nodes and run their pods until SIGTERM")
    run.add_argument("--kubeconfig", required=True, type=Path)
    run.add_argument("--nodes", type=int, default=None, help="node count (default: the profile's)")
    run.add_argument("--profile", default=None, help="profile YAML (default: clusters/embedded/profile.yaml)")
    run.add_argument("--pki-dir", type=Path, default=None,
                     help="the control plane's PKI directory (default: pki/ beside the kubeconfig)")
    run.add_argument("--name-prefix", default="rayproof-node")
    down = sub.add_parser("down", help="remove what an agent recorded under --state-dir")
    for p in (run, down):
        p.add_argument("--state-dir", required=True, type=Path)
        p.add_argument("--pod-network-dir", type=Path, default=None)
        p.add_argument("--platform", default="embedded", help="the pod network's platform name")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "down":
        from clusters.embedded.nodeagent.state import cleanup

        podnet = _podnet(args)
        done = cleanup(args.state_dir, (lambda rec: podnet.detach(rec.pod_key)) if podnet else None)
        print(json.dumps(done, indent=1))
        return 0

    from clusters.embedded.nodeagent.agent import NodeAgent

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent = NodeAgent(args.kubeconfig, args.profile, args.state_dir, _podnet(args), nodes=args.nodes,
                      pki=args.pki_dir, name_prefix=args.name_prefix)
    try:
        agent.start()
        print(json.dumps({"nodes": agent.node_names, "ports": agent.ports()}), flush=True)
        while not stop.wait(3600):  # sleep-ok: serve until a signal sets stop
            pass
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
