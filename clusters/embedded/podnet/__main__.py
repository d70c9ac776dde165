"""Run the pod network controller as a process of its own, or tear a pod network down.

``python -m clusters.embedded.podnet run --kubeconfig K --platform P [--state-dir D]``
serves the API server's CONNECT proxy and keeps the router's policy rules in
step until SIGTERM/SIGINT, then stops its threads and leaves the network in
place (a restarted controller picks it up again; the nodes stay linked).  It writes
``<state_dir>/controller.ready`` (its PID) once the first full sync is
applied, for a supervisor's health check, and removes it on exit.

``python -m clusters.embedded.podnet teardown --platform P --state-dir D``
removes every namespace, chain and allocation of the network (what
``network.teardown`` does for the platform's registered cleanups).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from clusters.embedded.podnet.controller import PodNetworkController
from clusters.embedded.podnet.network import teardown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusters.embedded.podnet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="watch the API server and keep the pod network in step")
    run.add_argument("--kubeconfig", required=True, type=Path)
    run.add_argument("--platform", required=True)
    run.add_argument("--state-dir", type=Path, help="default: <kubeconfig's directory>/podnet")
    run.add_argument("--recheck-established", action="store_true",
                     help="new policies also cut connections opened before them")
    run.add_argument("--no-network-policy", action="store_true",
                     help="accept NetworkPolicies but enforce none (a CNI without policy support)")
    run.add_argument("--policy-nodes", help="comma-separated nodes the NetworkPolicy engine runs on (default: "
                                            "every node); pods on others are never guarded")
    run.add_argument("--proxy-port", type=int, help="also serve the cluster proxy on 127.0.0.1:<port>")
    down = sub.add_parser("teardown", help="remove the whole pod network")
    down.add_argument("--platform", required=True)
    down.add_argument("--state-dir", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if args.command == "teardown":
        teardown(args.platform, str(args.state_dir))
        return 0

    ctl = PodNetworkController(args.kubeconfig, args.platform, state_dir=args.state_dir,
                               recheck_established=args.recheck_established, proxy_tcp_port=args.proxy_port,
                               enforce_policies=not args.no_network_policy,
                               policy_nodes=frozenset(args.policy_nodes.split(",")) if args.policy_nodes else None)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    ready = ctl.network.state_dir / "controller.ready"
    ctl.start()
    try:
        ctl.wait_ready()
        ready.write_text(str(os.getpid()))
        logging.info("pod network %s ready: proxy %s", args.platform, ctl.proxy.unix_path)
        done.wait()  # until SIGTERM/SIGINT
    finally:
        ready.unlink(missing_ok=True)
        ctl.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
