"""What the node agent made, written down so that anyone can undo it.

The agent's processes outlive the agent if it is SIGKILLed, and a test may
have to clean up after an agent it did not start. So every container
instance writes a record *before* its process runs (the cgroup it will join)
and right after (PID and kernel start time), and every pod records its
network namespace and host-side mounts. :func:`cleanup` reads only these
records: it kills processes found in the recorded cgroups (only the agent's
containers are ever placed there) and recorded PIDs whose start time still
matches (so a recycled PID is never signalled), removes the cgroups,
unmounts, detaches pod networks and removes the pod directories. It is safe
to repeat and to run from another process (``python -m
clusters.embedded.nodeagent down --state-dir D``).

Layout under the state dir::

    agent.json                       owner PID + start time, cgroup parent
    pods/<uid>/pod.json              namespace/name, node, pod key, netns, IP, host mounts
    pods/<uid>/volumes/...           materialised volumes
    pods/<uid>/etc/{hosts,resolv.conf,hostname}
    pods/<uid>/logs/<container>/<restart>.log
    pods/<uid>/containers/<name>/<restart>/{record.json,spec.json,tmp/,scratch/}
    pvc/<namespace>/<claim>/         persistentVolumeClaim data (kept: it is data)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from core import timeouts
from core.cgroups import V1_ROOT, V2_ROOT
from core.waiting import WaitTimeout, wait_for


def write_json(path: Path, data: Any) -> None:
    """Atomically: a reader (``down`` in another process) never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def alive(pid: int, start_ticks: int | None = None) -> bool:
    ticks = proc_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)


def cgroup_parent_name(state_dir: Path) -> str:
    """The agent's cgroup parent, unique per state dir so two agents never share one."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:10]
    return f"rayproof-nodeagent-{digest}"


def cgroup_pids(path: str) -> list[int]:
    try:
        return [int(p) for p in Path(path, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove_cgroup(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


@dataclass
class ContainerRecord:
    """One container instance (one start of one container)."""

    pod_uid: str
    container: str
    restart: int
    cgroups: list[str]
    pid: int | None = None
    start_ticks: int | None = None

    def path(self, state_dir: Path) -> Path:
        return state_dir / "pods" / self.pod_uid / "containers" / self.container / str(self.restart) / "record.json"

    def save(self, state_dir: Path) -> None:
        write_json(self.path(state_dir), asdict(self))


@dataclass
class PodRecord:
    """A pod's host-side resources."""

    uid: str
    namespace: str
    name: str
    node: str
    pod_key: str
    netns: str | None = None
    ip: str | None = None
    host_mounts: list[str] = field(default_factory=list)

    def path(self, state_dir: Path) -> Path:
        return state_dir / "pods" / self.uid / "pod.json"

    def save(self, state_dir: Path) -> None:
        write_json(self.path(state_dir), asdict(self))


def pod_records(state_dir: Path) -> list[PodRecord]:
    out = []
    for p in sorted((state_dir / "pods").glob("*/pod.json")):
        data = read_json(p)
        if data:
            with contextlib.suppress(TypeError):
                out.append(PodRecord(**data))
    return out


def container_records(state_dir: Path, pod_uid: str | None = None) -> list[ContainerRecord]:
    pattern = f"{pod_uid or '*'}/containers/*/*/record.json"
    out = []
    for p in sorted((state_dir / "pods").glob(pattern)):
        data = read_json(p)
        if data:
            with contextlib.suppress(TypeError):
                out.append(ContainerRecord(**data))
    return out


def kill_container_processes(records: Iterable[ContainerRecord], sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process of these container instances; return the PIDs signalled.

    Everything in a container's cgroup is the container's (it was placed there
    by the shim, or is a descendant); a recorded main PID is signalled only if
    its start time still matches.
    """
    hit: list[int] = []
    for rec in records:
        pids = set()
        for cg in rec.cgroups:
            pids.update(cgroup_pids(cg))
        if rec.pid and alive(rec.pid, rec.start_ticks):
            pids.add(rec.pid)
        for pid in sorted(pids):
            try:
                os.kill(pid, sig)
                hit.append(pid)
            except ProcessLookupError:
                pass
    return hit


def processes_left(records: Iterable[ContainerRecord]) -> list[int]:
    left: set[int] = set()
    for rec in records:
        for cg in rec.cgroups:
            left.update(p for p in cgroup_pids(cg) if alive(p))
        if rec.pid and alive(rec.pid, rec.start_ticks):
            left.add(rec.pid)
    return sorted(left)


def unmount(path: str) -> None:
    """Lazily unmount ``path`` if it is a mount point (safe to repeat)."""
    if os.path.ismount(path):
        subprocess.run(["umount", "-l", path], capture_output=True)


def cleanup_pod(state_dir: Path, rec: PodRecord, detach: Callable[[PodRecord], None] | None) -> list[str]:
    """Remove every host-side trace of one pod whose processes are already gone."""
    done = []
    for crec in container_records(state_dir, rec.uid):
        for cg in crec.cgroups:
            if os.path.isdir(cg):
                remove_cgroup(cg)
                done.append(f"cgroup {cg}")
    for m in rec.host_mounts:
        unmount(m)
    if detach is not None and rec.netns:
        detach(rec)
        done.append(f"netns {rec.netns}")
    pod_dir = state_dir / "pods" / rec.uid
    # Mounts under the pod dir (a tmpfs emptyDir) must be gone before rmtree,
    # which would otherwise descend into them.
    for dirpath, dirnames, _ in os.walk(pod_dir):
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if os.path.ismount(full):
                unmount(full)
                dirnames.remove(d)
    shutil.rmtree(pod_dir, ignore_errors=True)
    done.append(f"dir {pod_dir}")
    return done


def cleanup(state_dir: Path, detach: Callable[[PodRecord], None] | None = None) -> list[str]:
    """Kill every recorded container process and remove everything recorded.

    ``detach`` releases a pod's network (the pod network's ``detach``); when
    None, the recorded namespace is deleted with ``ip netns delete``.
    """
    state_dir = Path(state_dir)
    if detach is None:
        def detach(rec: PodRecord) -> None:
            if rec.netns:
                subprocess.run(["ip", "netns", "delete", rec.netns], capture_output=True)
    done: list[str] = []
    records = container_records(state_dir)
    killed = kill_container_processes(records)
    if killed:
        done.append(f"killed {len(killed)} processes")
    try:
        wait_for(lambda: processes_left(records), lambda left: not left, timeout=timeouts.PROCESS_EXIT,
                 description=f"container processes recorded under {state_dir} to exit", interval=0.1)
    except WaitTimeout:
        # Stuck in D state: kill again, report, and remove what can be removed.
        kill_container_processes(records)
        done.append(f"processes still exiting: {processes_left(records)}")
    for rec in pod_records(state_dir):
        done += cleanup_pod(state_dir, rec, detach)
    # Container dirs of pods whose pod.json was never written (crash mid-start).
    if (state_dir / "pods").is_dir():
        for crec in records:
            for cg in crec.cgroups:
                remove_cgroup(cg)
        shutil.rmtree(state_dir / "pods", ignore_errors=True)
    parent = cgroup_parent_name(state_dir)
    for root in (V1_ROOT, V2_ROOT):
        path = root / parent
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir():
                    with contextlib.suppress(OSError):
                        child.rmdir()
            with contextlib.suppress(OSError):
                path.rmdir()
                done.append(f"cgroup {path}")
    return done
