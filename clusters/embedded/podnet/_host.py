"""Small wrappers over iproute2, iptables and setns(2), shared by the pod network modules.

Everything here acts inside a *named* network namespace given by the caller;
nothing touches the machine's own (root) namespace, which is what keeps pod
traffic on this machine.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


class Threads:
    """Daemon threads of one component, tracked until each returns (its
    ``alive`` list is what a caller waits on after stopping it)."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=self._run, args=(target, *args), daemon=True, name=self.name)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _run(self, target: Callable[..., None], *args: object) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def alive(self) -> list[threading.Thread]:
        with self._lock:
            return [t for t in self._threads if t.is_alive()]


class PodNetworkUnavailable(RuntimeError):
    """The pod network cannot be built here (not root, or iproute2/iptables missing)."""


class CommandFailed(RuntimeError):
    """An ip/iptables command failed; the message carries its argv and stderr."""

    def __init__(self, argv: list[str], returncode: int, stderr: str):
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"{' '.join(argv)} failed ({returncode}): {stderr.strip()}")


def check_available() -> None:
    """Raise :class:`PodNetworkUnavailable` saying what to do when the pod network cannot work here."""
    if os.geteuid() != 0:
        raise PodNetworkUnavailable(
            "the embedded pod network creates network namespaces and iptables rules, which needs root: "
            "run the platform (and these tests) as root")
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables"), ("iptables-restore", "iptables"),
                          ("iptables-save", "iptables")):
        if shutil.which(tool) is None:
            raise PodNetworkUnavailable(f"'{tool}' is missing: apt-get install -y {package}")


def run(argv: list[str], *, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise CommandFailed(argv, proc.returncode, proc.stderr or proc.stdout)
    return proc


def netns_exec(netns: str) -> list[str]:
    """argv prefix that runs a command inside the named network namespace."""
    return ["ip", "netns", "exec", netns]


def netns_exists(netns: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, netns))


def list_netns(prefix: str) -> list[str]:
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def add_netns(netns: str) -> bool:
    """Create the namespace with lo up; return False when it already existed."""
    if netns_exists(netns):
        return False
    proc = run(["ip", "netns", "add", netns], check=False)
    if proc.returncode != 0:
        if "File exists" in proc.stderr:
            return False
        raise CommandFailed(["ip", "netns", "add", netns], proc.returncode, proc.stderr)
    run(["ip", "-n", netns, "link", "set", "lo", "up"])
    return True


def delete_netns(netns: str) -> None:
    """Delete one namespace; one already gone is not an error (so teardown can repeat)."""
    proc = run(["ip", "netns", "delete", netns], check=False)
    if proc.returncode != 0 and "No such file" not in proc.stderr:
        raise CommandFailed(["ip", "netns", "delete", netns], proc.returncode, proc.stderr)


def netns_pids(netns: str) -> list[int]:
    proc = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def sysctl(netns: str, key: str, value: str) -> None:
    """Set a sysctl inside ``netns`` (net.* sysctls are per namespace)."""
    run(netns_exec(netns) + ["sysctl", "-q", "-w", f"{key}={value}"])


def iptables_restore(netns: str, text: str) -> None:
    """Apply ``text`` with ``iptables-restore --noflush``: each table's COMMIT is one atomic transaction."""
    run(netns_exec(netns) + ["iptables-restore", "--noflush", "-w"], input=text)


def iptables_save(netns: str, table: str) -> str:
    return run(netns_exec(netns) + ["iptables-save", "-t", table]).stdout


def chains_in(saved: str, prefix: str) -> set[str]:
    """User chains named ``prefix*`` declared in one table of ``iptables-save`` output."""
    return {line[1:].split()[0] for line in saved.splitlines() if line.startswith(":" + prefix)}


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a fresh OS thread that has joined ``netns``; return its result.

    setns(2) with CLONE_NEWNET changes only the calling thread, so sockets made
    by ``fn`` live in ``netns`` while the rest of this process stays where it
    was.  The helper thread ends right after, so no Python thread is ever left
    in the wrong namespace.  (os.setns exists only from Python 3.12.)
    """
    libc = ctypes.CDLL(None, use_errno=True)
    box: dict[str, object] = {}

    def body() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into network namespace {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"setns-{netns}", daemon=True)
    thread.start()
    thread.join()  # fn only creates sockets: returns at once
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
