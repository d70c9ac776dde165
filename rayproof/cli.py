"""The ``rayproof`` command."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayproof")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version")
    args = parser.parse_args(argv)
    if args.command == "version":
        from rayproof import __version__
        print(__version__)
    return 0
