"""Lock files the suite's processes on one machine share, in a directory only this user may use.

Clauses running side by side hold shares of the certified cluster as flocks
(``fixtures/sharing.py``). A lock in a directory another user can write could
be swapped for a symbolic link to a file of theirs (and a root-run suite
would then open it): so the directory is this user's own, mode 0700, checked
as found rather than trusted, and a lock file is opened without following a
symbolic link. :class:`UnsafePath` says which path is wrong and what to do.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

RUNTIME_DIR_ENV = "RAYPROOF_RUNTIME_DIR"


class UnsafePath(RuntimeError):
    """A lock directory or file that another user could control."""


def runtime_dir() -> Path:
    """``$RAYPROOF_RUNTIME_DIR``, else ``/run/rayproof`` for root, else
    ``$XDG_RUNTIME_DIR/rayproof`` or ``~/.cache/rayproof/run``; made mode
    0700 and checked with :func:`secure_dir`."""
    env = os.environ.get(RUNTIME_DIR_ENV)
    if env:
        path = Path(env).expanduser()
    elif os.geteuid() == 0 and Path("/run").is_dir():
        path = Path("/run/rayproof")
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "rayproof"
    else:
        path = Path.home() / ".cache" / "rayproof" / "run"
    return secure_dir(path)


def secure_dir(path: Path) -> Path:
    """``path``, created mode 0700 if missing; refused unless it is a real
    directory (no symbolic link) owned by this user that no one else may use."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = _unsafe(os.lstat(path))
    if problem:
        raise UnsafePath(f"the lock directory {path} {problem}; remove it (the suite recreates it, mode 0700) or set "
                         f"{RUNTIME_DIR_ENV} to a directory of your own")
    return path


def _unsafe(st: os.stat_result) -> str | None:
    """What makes a lock directory unsafe, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}: others may use it"
    return None


def open_lock(path: Path) -> int:
    """A descriptor of the lock file ``path`` (created mode 0600), never through a symbolic link."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"the lock file {path} is a symbolic link; the suite refuses to follow it. Remove it "
                             "and look for who made it") from None
        raise


def run_record(run_id: str) -> Path:
    """Where a local run's owner is recorded: ``<runtime dir>/runs/<run_id>/``,
    a directory only this user may write (:func:`secure_dir`),
    never the run's scratch under ``/tmp``, where any local user could plant
    an owner that `clean` would act on."""
    return secure_dir(secure_dir(runtime_dir() / "runs") / run_id)


def run_records() -> dict[str, Path]:
    """Every local run with an owner record: run id -> its record directory."""
    root = secure_dir(runtime_dir() / "runs")
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir() and (d / "owner").exists()}
