"""What this machine must offer an embedded platform, checked before anything is cleared or started.

* The nodes (kubelet, containerd and runc: ``nodes/``) are built for cgroup v1 hierarchies.
* Enough inotify instances. The kernel caps them per user
  (``fs.inotify.max_user_instances``, 128 by default) across every process of
  that user, pods included, and every platform on the machine shares the cap.
  A program that finds none left fails at start with "too many open files"
  (kueue's certificate watcher did, in a rehearsal beside other platforms),
  which says nothing of the cause; this check says it first.
* Disk for the nodes. Each node's containerd keeps its own unpacked copy of
  every image its pods run (containerd instances share none), and the Ray
  image with the pinned torch unpacks to 6.15 GiB per node (`bench nodes`).
  ``up`` pulls the pre-pulled images onto one node at a time and makes each
  later node's copy hard links to the first's (``nodes/sharedlayers.py``),
  so at most two copies are ever on disk at once; without pre-pulled images
  every node pulls its own, and four nodes want 25 GiB. A disk filled
  halfway through a certification would be taken from etcd too.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

from clusters.embedded.controlplane import fd_targets
from clusters.embedded.nodes.node import v1_hierarchies
from core import timeouts
from core.locks import open_lock, runtime_dir
from core.waiting import wait_for

MAX_USER_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")
# Instances each part holds once up, counted on running platforms (a process's
# descriptors that link to anon_inode:inotify, summed by program):
CONTROL_PLANE_INSTANCES = 20  # kube-controller-manager 8, kube-apiserver 6, kueue 3, kube-scheduler 3
REAL_NODE_INSTANCES = 8  # kubelet 6, containerd 1, kube-proxy 1
# Disk the nodes take: the Ray image unpacked (measured per node by `bench
# nodes`), and each node's pods' writable layers and logs.
RAY_IMAGE_UNPACKED_GIB = 6.15
REAL_NODE_OWN_BYTES = 2**30


def real_nodes_disk_bytes(node_count: int, images_shared: bool) -> int:
    """Disk ``node_count`` real nodes need at most: two copies of the Ray image while a node's pull is
    being shared with the first node's (``images_shared``: the profile pre-pulls images), else one per node."""
    copies = min(node_count, 2) if images_shared else node_count
    return int(copies * RAY_IMAGE_UNPACKED_GIB * 2**30) + node_count * REAL_NODE_OWN_BYTES


class UpRefused(RuntimeError):
    """``up`` refused before it started anything; the message says what to do."""


class MachineUnfit(UpRefused):
    """This machine cannot run the platform as its profile asks."""


def inotify_instances_needed(node_count: int) -> int:
    return CONTROL_PLANE_INSTANCES + REAL_NODE_INSTANCES * node_count


def inotify_instances_in_use(proc: Path = Path("/proc"), uid: int | None = None) -> int:
    """Inotify instances held now by processes whose real user is ``uid`` (default: this process's)."""
    uid = os.getuid() if uid is None else uid
    return sum(fd_targets(entry.name).count("anon_inode:inotify")
               for entry in proc.iterdir() if entry.name.isdigit() and _real_uid(entry) == uid)


def _real_uid(entry: Path) -> int:
    """The real user of process ``entry`` (the kernel counts instances by it); -1 once it has ended."""
    try:
        status = (entry / "status").read_text()
    except OSError:
        return -1
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), -1)


def check_inotify(name: str, node_count: int, others: list[str], *, limit: int | None = None,
                  in_use: int | None = None) -> None:
    """Raise :class:`MachineUnfit` when platform ``name`` would find too few inotify instances left."""
    limit = int(MAX_USER_INSTANCES.read_text()) if limit is None else limit
    in_use = inotify_instances_in_use() if in_use is None else in_use
    needed = inotify_instances_needed(node_count)
    if in_use + needed <= limit:
        return
    nodes = f"{node_count} nodes at {REAL_NODE_INSTANCES} each"
    raise MachineUnfit(
        f"platform {name} needs about {needed} inotify instances (control plane {CONTROL_PLANE_INSTANCES}, {nodes}), "
        f"and this machine lets a user hold {limit} (fs.inotify.max_user_instances), {in_use} of them in use now: "
        + (f"take another embedded platform down (`bin/rayproof down --name NAME`; here: {', '.join(others)}), or "
           if others else "stop what else holds them, or ")
        + "raise the limit (as root: sysctl -w fs.inotify.max_user_instances=512)")


def check_cgroups() -> None:
    """Raise :class:`MachineUnfit` when this machine cannot hold the platform's nodes."""
    if not v1_hierarchies():
        raise MachineUnfit("the embedded platform's nodes (kubelet, containerd, runc) are built for cgroup v1 "
                           "hierarchies, and this machine mounts none (cgroup v2 only is not done yet): run the "
                           "embedded platform on a machine with cgroup v1, or certify an existing cluster "
                           "(--kubeconfig)")


def check_disk(name: str, node_count: int, where: Path, others: list[str], *,
               images_shared: bool, free: int | None = None) -> None:
    """Raise :class:`MachineUnfit` when the filesystem of ``where`` (the platform's
    directory, or the nearest that exists) has too little room for ``node_count``
    nodes' images."""
    needed = real_nodes_disk_bytes(node_count, images_shared)
    if free is None:
        existing = next(p for p in (where, *where.parents) if p.exists())
        free = shutil.disk_usage(existing).free
    if free >= needed:
        return
    gib = 2**30
    raise MachineUnfit(
        f"platform {name}'s {node_count} real nodes need about {needed / gib:.0f} GiB of disk (each node's "
        f"containerd unpacks its own copy of the Ray image, {RAY_IMAGE_UNPACKED_GIB} GiB, "
        + ("two at a time before the copies are shared" if images_shared else "none of them shared")
        + f", beside its pods' layers and logs), and "
        f"{where} has {free / gib:.1f} GiB free: "
        + (f"take another embedded platform down (`bin/rayproof down --name NAME`; here: {', '.join(others)}), "
           if others else "")
        + "free disk there, or run fewer nodes (nodes.count in the platform profile)")


@contextlib.contextmanager
def starts_lock(progress: Callable[[str], None]) -> Iterator[None]:
    """Hold this machine's one start of an embedded platform: from the checks of what is left (inotify
    instances, disk) until the platform is up, so a platform starting beside another counts what that one
    holds instead of what it held before it started."""
    fd = open_lock(runtime_dir() / "platform-starts.lock")
    try:
        def taken() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        if not taken():
            progress("waiting for another embedded platform on this machine to finish starting ...")
            wait_for(taken, timeout=timeouts.PLATFORM_ROOM, interval=2, ignore=(),
                     description="another embedded platform on this machine to finish starting")
        yield
    finally:
        os.close(fd)  # releases the lock
