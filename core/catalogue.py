"""The clause catalogue: every clause id a full certification runs.

Read from the clause marks of the test files under ``conformance/`` without
importing them, so a report can tell a complete run from a subset offline
(``tests/test_plugin_and_cli.py`` checks it against what pytest collects).
"""
from __future__ import annotations

import re
from pathlib import Path

CONFORMANCE = Path(__file__).resolve().parents[1] / "conformance"
# The clause judged only by a certification that upgrades the KubeRay
# operator (`certify --upgrade-to`); not applicable otherwise.
UPGRADE_CLAUSE = "UPG-1"
# Clauses certify runs at once (its pytest-xdist workers): Kubernetes
# clauses run side by side in what the certified cluster holds
# (fixtures/sharing.py), beside the runtime tier's local Ray clusters and the
# units; a clause mostly waits on the platform's own timeouts, so three keep
# two cores busy.
CLAUSES_AT_ONCE = 3
_CLAUSE_MARK = re.compile(r'^@pytest\.mark\.clause\(\s*"([^"]+)"\s*\)', re.MULTILINE)


def catalogue() -> list[str]:
    """Every clause id under ``conformance/``, sorted."""
    return sorted({cid for path in CONFORMANCE.rglob("test_*.py") for cid in _CLAUSE_MARK.findall(path.read_text())})


_CLAUSE_TEST = re.compile(r'^@pytest\.mark\.clause\(\s*"([^"]+)"\s*\)\n(?:[#@].*\n)*def (test_\w+)', re.MULTILINE)


def clause_tests() -> dict[str, str]:
    """Every clause id and the pytest node id of its test (``conformance/<family>/test_x.py::test_y``)."""
    root = CONFORMANCE.parent
    return {cid: f"{path.relative_to(root)}::{fn}" for path in sorted(CONFORMANCE.rglob("test_*.py"))
            for cid, fn in _CLAUSE_TEST.findall(path.read_text())}
