"""The suite runs on exactly what its lock names.

requirements.lock pins every Python package with its hashes; bin/rayproof
installs it with ``pip --require-hashes --no-deps``. These tests keep the
lock and pyproject.toml agreeing, every pin hashed, and the environment the
tests run in equal to the lock.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)(?:\s*;\s*(?P<marker>[^\\]+?))?\s*\\?$")


def _pins() -> list[tuple[str, str, str | None, list[str]]]:
    """(name, version, marker, hashes) of every entry of the lock."""
    pins = []
    for line in LOCK.read_text().splitlines():
        if line.startswith("    --hash=sha256:"):
            pins[-1][3].append(line.split(":", 1)[1].rstrip(" \\"))
            continue
        match = PIN.match(line)
        if match:
            pins.append((canonicalize_name(match["name"]), match["version"], match["marker"], []))
    return pins


def _here(marker: str | None) -> bool:
    return marker is None or Marker(marker).evaluate()


def test_every_pin_is_exact_and_hashed() -> None:
    pins = _pins()
    assert len(pins) > 100, "the lock lists the whole environment, transitive packages included"
    unhashed = [name for name, _, _, hashes in pins if not hashes]
    assert not unhashed, f"pins without a hash: {unhashed}"
    assert all(len(h) == 64 for *_, hashes in pins for h in hashes)


def test_the_lock_satisfies_pyproject() -> None:
    """Each dependency of pyproject.toml is locked, on this interpreter, at a
    version its range allows (a range changed without re-locking fails here)."""
    locked = {name: version for name, version, marker, _ in _pins() if _here(marker)}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wrong = []
    for dep in map(Requirement, deps):
        version = locked.get(canonicalize_name(dep.name))
        if version is None or not dep.specifier.contains(version, prereleases=True):
            wrong.append(f"{dep} (locked: {version})")
    assert not wrong, f"requirements.lock does not satisfy pyproject.toml: {wrong}; re-run the command in its header"


def test_this_environment_is_the_locked_one() -> None:
    """What the tests run on is what the lock names, package for package."""
    if not Path(sys.prefix, "requirements.lock").is_file():
        import pytest

        pytest.skip("not run from bin/rayproof's environment (no requirements.lock in it)")
    differ = []
    for name, version, marker, _ in _pins():
        if not _here(marker):
            continue
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            installed = None
        if installed != version:
            differ.append(f"{name}: locked {version}, installed {installed}")
    assert not differ, differ
