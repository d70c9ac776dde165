"""Which process owns what, and signals: the records every layer keeps.

Owner tokens (:class:`Owner`: host, boot id, PID namespace, PID, start
time and a nonce) for the ``rayproof.io/owner`` annotation, owner files
(``<dir>/owner``: the token of the process that made a local run), users
directories (one ``<pid>`` file per process using a shared thing, such as an
embedded platform), and the SIGTERM and parent-death handling that makes an
interrupted session unwind. A PID counts as its process only in the boot and
PID namespace it was recorded in, and only while the process that started at
the recorded time runs (a recycled PID is not its owner).
"""
from __future__ import annotations

import ctypes
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil

_interrupted = False


def note_interrupted() -> None:
    """This process is unwinding after Ctrl-C or SIGTERM: cleanups ask for
    deletion and wait for nothing (pytest-xdist gives an interrupted worker
    about 10 s before it stops it)."""
    global _interrupted
    _interrupted = True


def interrupted() -> bool:
    return _interrupted


def unwind_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler: SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C,
    so the cleanup of fixtures and of the certify command runs."""
    note_interrupted()
    raise KeyboardInterrupt(f"signal {signum}")


def as_typed_at_a_terminal() -> None:
    """``preexec_fn`` of a child that stands for a command a user typed: Ctrl-C
    (SIGINT) back to its default. A runner started in the background (a
    non-interactive shell's ``cmd &``, as CI runners do) has SIGINT ignored,
    every child inherits that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

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


def _running(pid: int, started: float, tolerance: float = 0.5) -> bool:
    """Whether the process that started ``started`` seconds after boot still
    runs (not a recycled PID, not a zombie).

    Seconds since boot, from the kernel's start time in clock ticks: fixed for
    a process's life. psutil's wall-clock ``create_time()`` adds the boot time
    that /proc/stat derives anew at each read, in whole seconds, so where the
    clock is slewed (NTP on a long-running machine) it steps by a second, and
    a live owner compared with its recorded wall-clock start looked dead."""
    since_boot = started_since_boot(pid)
    return since_boot is not None and abs(since_boot - started) < tolerance and alive(pid)


def started_since_boot(pid: int) -> float | None:
    """When ``pid`` started, in seconds after boot (None: no such process):
    /proc/<pid>/stat's start time in clock ticks, which never changes."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime


# -- owner identity -------------------------------------------------------------
#
# A process is named by where its PID means something: the kernel's boot (a
# reboot, or another machine, has another boot id) and the PID namespace (two
# containers on one host, even with one hostname, have two). Only a process of
# this boot and this PID namespace can be judged alive or gone from here; any
# other owner is judged by its run's lease on the cluster (fixtures/leases.py),
# never by its PID. The nonce tells apart two owners that reuse a PID.
# rp3: the start is seconds since boot. rp2 tokens (wall-clock start, an
# earlier rayproof's) are still read, with a tolerance for the boot time's
# one-second steps.
TOKEN_PREFIX = "rp3"
LEGACY_TOKEN_PREFIX = "rp2"


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str
    pidns: int
    pid: int
    started: float  # seconds after boot
    nonce: str
    approximate: bool = False  # from an rp2 token: its wall-clock start, converted

    @property
    def token(self) -> str:
        """The owner as one string (the ``rayproof.io/owner`` annotation, owner and users files)."""
        return "/".join((TOKEN_PREFIX, self.host, self.boot, str(self.pidns), str(self.pid), repr(self.started),
                         self.nonce))

    @property
    def local(self) -> bool:
        """Whether this owner's PID can be judged from here (this boot, this PID namespace)."""
        here = me()
        return (self.boot, self.pidns) == (here.boot, here.pidns)

    def alive(self) -> bool | None:
        """Whether the owner runs; None where that cannot be told from here."""
        return _running(self.pid, self.started, 1.5 if self.approximate else 0.5) if self.local else None


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


_nonces: dict[int, str] = {}


def me() -> Owner:
    """This process as an owner (a new nonce in each process, forked ones included)."""
    pid = os.getpid()
    nonce = _nonces.setdefault(pid, secrets.token_hex(4))
    started = started_since_boot(pid)
    assert started is not None, "this process has a start time"
    return Owner(os.uname().nodename, _boot_id(), _pid_namespace(), pid, started, nonce)


def parse_token(token: str) -> Owner | None:
    """The owner a token names; None for anything else (a token of an older
    rayproof, ``host:pid:start``, names no boot or PID namespace and is never
    judged by its PID)."""
    parts = token.split("/")
    if len(parts) != 7 or parts[0] not in (TOKEN_PREFIX, LEGACY_TOKEN_PREFIX):
        return None
    try:
        if parts[0] == LEGACY_TOKEN_PREFIX:
            return Owner(parts[1], parts[2], int(parts[3]), int(parts[4]), float(parts[5]) - psutil.boot_time(),
                         parts[6], approximate=True)
        return Owner(parts[1], parts[2], int(parts[3]), int(parts[4]), float(parts[5]), parts[6])
    except ValueError:
        return None


def owner_token() -> str:
    """This process's owner token, for the ``rayproof.io/owner`` annotation."""
    return me().token


def token_alive(token: str) -> bool | None:
    """Whether the process a token names lives: None where that cannot be told
    from here (another boot or PID namespace, or a token without them)."""
    owner = parse_token(token)
    return owner.alive() if owner else None


def token_pid(token: str) -> int | None:
    owner = parse_token(token)
    return owner.pid if owner else None


# -- owner files and users directories ----------------------------------------------


def owner_pid(run_dir: Path) -> int | None:
    try:
        return token_pid((run_dir / "owner").read_text())
    except FileNotFoundError:
        return None


def owner_alive(run_dir: Path) -> bool | None:
    """Whether the owner recorded in ``<run_dir>/owner`` runs (None: it cannot be told from here)."""
    try:
        return token_alive((run_dir / "owner").read_text())
    except FileNotFoundError:
        return False


def write_owner(run_dir: Path) -> None:
    (run_dir / "owner").write_text(owner_token())


def join_users(users_dir: Path) -> None:
    """Record this process among the users of a shared thing (an embedded
    platform), as a ``<pid>`` file holding its owner token."""
    users_dir.mkdir(exist_ok=True)
    (users_dir / str(os.getpid())).write_text(owner_token())


def leave_users(users_dir: Path) -> None:
    (users_dir / str(os.getpid())).unlink(missing_ok=True)


def recorded_users(users_dir: Path) -> dict[int, Owner | None]:
    """PID -> owner of every user recorded by :func:`join_users` (None: a record that names no owner)."""
    users = {}
    for entry in sorted(users_dir.iterdir()) if users_dir.is_dir() else []:
        try:
            users[int(entry.name)] = parse_token(entry.read_text())
        except (OSError, ValueError):
            continue  # being written or removed meanwhile
    return users


def live_pids_in(users_dir: Path) -> list[int]:
    """The recorded users that may still run: alive here, or not judgeable from
    here (a user in another PID namespace keeps the thing shared). A reused PID
    is not taken for its user; a record that names no owner (an older
    rayproof's) is no user."""
    return [pid for pid, owner in recorded_users(users_dir).items()
            if owner is not None and owner.alive() is not False]


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
