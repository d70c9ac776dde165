"""ruff over the whole tree and mypy (strict) over core/, reports/ and chaos/,
from the lint tools' own environment (requirements-lint.lock), which
bin/rayproof installs and names in RAYPROOF_LINT_BIN. Configuration:
pyproject.toml's [tool.ruff] and [tool.mypy]."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    where = os.environ.get("RAYPROOF_LINT_BIN")
    if not where or not (Path(where) / name).is_file():
        pytest.fail(f"{name} is not installed: run the tests through bin/rayproof test, which installs the lint tools "
                    f"(requirements-lint.lock) and sets RAYPROOF_LINT_BIN", pytrace=False)
    return str(Path(where) / name)


def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_mypy_strict_on_the_base_the_reports_and_the_faults() -> None:
    proc = subprocess.run([_tool("mypy"), "--python-executable", sys.executable, "--no-incremental"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
