"""Which process owns what, and signals: the records every layer keeps.

Owner files (``<dir>/owner``: the PID and start time of the process that
made a local run), users directories (one ``<pid>`` file per process using a
shared thing, such as an embedded platform), owner tokens for the
``rayproof.io/owner`` annotation, and the SIGTERM and parent-death handling
that makes an interrupted session unwind. A PID counts as its process only
while the process that started at the recorded time runs (a recycled PID is
not its owner).
"""
from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import psutil


def unwind_on_sigterm(signum, frame) -> None:
    """A SIGTERM handler: SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C,
    so the cleanup of fixtures and of the certify command runs."""
    raise KeyboardInterrupt(f"signal {signum}")

# A nested pytest session (a self-test's clause run) is started with this set
# to its parent's PID, and stops when that parent goes.
DIE_WITH_PARENT_ENV = "RAYPROOF_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when ``parent`` exits, so a
    session whose caller was killed unwinds (SIGTERM unwinds like Ctrl-C)
    instead of running on with nobody to report to."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # gone before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _running(pid: int, started: float) -> bool:
    """Whether the process that started at ``started`` still runs (not a recycled PID, not a zombie)."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0 and alive(pid)
    except psutil.NoSuchProcess:
        return False


def owner_pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "owner").read_text().partition(" ")[0])
    except (FileNotFoundError, ValueError):
        return None


def owner_alive(run_dir: Path) -> bool:
    try:
        pid, _, started = (run_dir / "owner").read_text().partition(" ")
        return _running(int(pid), float(started))
    except (FileNotFoundError, ValueError):
        return False


def write_owner(run_dir: Path) -> None:
    me = psutil.Process(os.getpid())
    (run_dir / "owner").write_text(f"{me.pid} {me.create_time()}")


def join_users(users_dir: Path) -> None:
    """Record this process among the users of a shared thing (an embedded
    platform), as ``<pid>`` files holding the process's start time."""
    me = psutil.Process(os.getpid())
    users_dir.mkdir(exist_ok=True)
    (users_dir / str(me.pid)).write_text(str(me.create_time()))


def leave_users(users_dir: Path) -> None:
    (users_dir / str(os.getpid())).unlink(missing_ok=True)


def recorded_users(users_dir: Path) -> dict[int, float]:
    """PID -> start time of every user recorded by :func:`join_users`."""
    users = {}
    for entry in sorted(users_dir.iterdir()) if users_dir.is_dir() else []:
        try:
            users[int(entry.name)] = float(entry.read_text())
        except (OSError, ValueError):
            continue  # being written or removed meanwhile
    return users


def live_pids_in(users_dir: Path) -> list[int]:
    """The recorded users that still run (a reused PID is not taken for its user)."""
    return [pid for pid, started in recorded_users(users_dir).items() if _running(pid, started)]


def owner_token() -> str:
    """``host:pid:start time`` of this process, for the owner annotation."""
    me = psutil.Process(os.getpid())
    return f"{os.uname().nodename}:{me.pid}:{me.create_time()}"


def token_alive(token: str) -> bool | None:
    """Whether the process named by an owner token lives (None: another host's)."""
    host, _, rest = token.partition(":")
    pid, _, started = rest.partition(":")
    if host != os.uname().nodename:
        return None
    try:
        return _running(int(pid), float(started))
    except ValueError:
        return False


def token_pid(token: str) -> int | None:
    try:
        return int(token.split(":")[1])
    except (IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
