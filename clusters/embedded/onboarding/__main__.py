"""``python -m clusters.embedded.onboarding run --kubeconfig K --ready-file F``:
install the shipped onboarding classes, then onboard labelled namespaces
until SIGTERM/SIGINT. ``F`` holds the PID once the classes are installed."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from clusters.embedded.onboarding.controller import Onboarding


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusters.embedded.onboarding", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="onboard labelled namespaces")
    run.add_argument("--kubeconfig", required=True, type=Path)
    run.add_argument("--ready-file", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kubernetes import config

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    onboarding = Onboarding(config.new_client_from_config(config_file=str(args.kubeconfig)), stop)
    onboarding.install_classes()
    args.ready_file.write_text(str(os.getpid()))
    try:
        onboarding.run()
    finally:
        args.ready_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
