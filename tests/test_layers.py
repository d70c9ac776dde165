"""The folders import downwards only (pyproject.toml's [tool.importlinter] contracts)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "0 broken" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


# A clause reads as named steps: its test function (docstring, the MUST, included) fits on a screen.
CLAUSE_FUNCTION_LINES = 60


def test_every_clause_function_reads_as_named_steps() -> None:
    import ast

    long = []
    for path in sorted((REPO / "conformance").rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > CLAUSE_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}::{node.name} ({lines} lines)")
    assert not long, (f"clause functions over {CLAUSE_FUNCTION_LINES} lines; split them into named steps: "
                      + ", ".join(long))
