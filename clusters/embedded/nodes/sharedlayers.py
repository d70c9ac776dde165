"""Unpacked image layers held once on the machine, not once per node.

Every node's containerd unpacks the images it pulls into snapshots of its own
overlayfs snapshotter (``snapshots/<id>/fs`` under its root), and four
containerds cannot share one store (each keeps its own metadata and garbage
collection, NOTES). So four nodes that pulled the Ray image held four copies
of its 6 GB. This runs after the pre-pull at ``up``: a committed snapshot's
key is its layer's chain ID (a digest over the uncompressed content of the
layer and every layer below it, checked by containerd as it unpacked), so two
nodes' snapshots with one key hold the same files. Each regular file of such a
snapshot on a later node becomes a hard link to the same file of the first
node that has it, provided the two still agree in size, mode, owner and
modification time. The machine's filesystem then holds it once.

Containerd and kubelet notice nothing: the directory entries, sizes and
contents are what they were. The lower directories of an overlay are never
written (a container's writes are copied up into its own upper directory, and
copy-up writes a new file rather than into the linked one), and removing an
image on one node unlinks only that node's names. A snapshot that a mounted
overlay uses is left as it is, since overlayfs does not allow a lower
directory to change under a mount; after the pre-pull none of the pre-pulled
images' snapshots is mounted (their containers ran ``true`` and ended).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable, Mapping

from clusters.embedded.nodes.node import Node

_IN_NODE_ROOT = "/var/lib/"  # the node's /var/lib is its own var-lib directory (node.py's enter script)


@dataclass
class Shared:
    """What :func:`share` did: files made links, the bytes that no longer take space, and what it left."""
    snapshots: int = 0  # later nodes' snapshots whose files were compared with the first node's
    files: int = 0
    bytes: int = 0
    differing: int = 0  # files that disagreed with the first node's (left as they are)
    skipped_mounted: int = 0

    def add(self, other: "Shared") -> None:
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def summary(self) -> str:
        return (f"{self.files} files in {self.snapshots} snapshots made links to the first node's, "
                f"{self.bytes / 2**30:.2f} GiB freed"
                + (f"; {self.differing} files differed and were kept" if self.differing else "")
                + (f"; {self.skipped_mounted} layers in use left as they are" if self.skipped_mounted else ""))


def committed_chains(listing: str) -> dict[str, str]:
    """``{key: parent}`` of the committed snapshots in ``ctr snapshots ls`` output (a parentless one's
    parent is ``""``)."""
    chains: dict[str, str] = {}
    for line in listing.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[-1] == "Committed":
            chains[fields[0]] = fields[1] if len(fields) == 3 else ""
    return chains


def lower_directories(mounts: list[dict]) -> list[str]:
    """The snapshot directories, top first, of the mounts a view of a committed snapshot returns (a
    bind mount of its one directory, or an overlay of them all)."""
    if len(mounts) != 1:
        raise ValueError(f"a view's mounts were not one mount: {mounts}")
    mount = mounts[0]
    if mount.get("Type") == "bind":
        return [mount["Source"]]
    for option in mount.get("Options") or []:
        if option.startswith("lowerdir="):
            return option[len("lowerdir="):].split(":")
    raise ValueError(f"a view's mount names no lower directory: {mount}")


def link_identical_files(first: Path, later: Path) -> Shared:
    """Make each regular file under ``later`` a hard link to the file at the same path under ``first``
    where the two agree in size, mode, owner and modification time."""
    done = Shared(snapshots=1)
    for directory, _subdirs, names in os.walk(later):
        for name in names:
            path = os.path.join(directory, name)
            ours = os.lstat(path)
            if not stat.S_ISREG(ours.st_mode):  # symbolic links, whiteouts: kept as they are
                continue
            twin = os.path.join(first, os.path.relpath(path, later))
            try:
                theirs = os.lstat(twin)
            except FileNotFoundError:
                done.differing += 1
                continue
            if ours.st_ino == theirs.st_ino:
                continue
            if (ours.st_size, ours.st_mode, ours.st_uid, ours.st_gid, ours.st_mtime_ns) != \
                    (theirs.st_size, theirs.st_mode, theirs.st_uid, theirs.st_gid, theirs.st_mtime_ns):
                done.differing += 1
                continue
            staged = os.path.join(directory, f".rayproof-link-{name}")
            with contextlib.suppress(FileNotFoundError):  # left by a run that was killed here
                os.unlink(staged)
            os.link(twin, staged)
            os.replace(staged, path)
            done.files += 1
            if ours.st_nlink == 1:
                done.bytes += ours.st_blocks * 512
    return done


def mounted_directories(mountinfo: str) -> set[str]:
    """The directories, as the mounting process names them, that mounts in ``mountinfo``
    (``/proc/<pid>/mountinfo``) are made of: an overlay's lower and upper directories, and the mount
    point of a bind mount of a directory (whose own name there is not in ``mountinfo``)."""
    used: set[str] = set()
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, source_fields = before.split(), after.split()
        if len(source_fields) >= 3 and source_fields[0] == "overlay":
            for option in source_fields[2].split(","):
                name, _, value = option.partition("=")
                if name.rstrip("+") in ("lowerdir", "upperdir", "datadir"):
                    used.update(value.split(":"))
        elif len(fields) >= 5 and fields[3] != "/":
            used.add(fields[4])
    return used


def _in_use(containerd_pid: int) -> set[tuple[int, int]]:
    """(device, inode) of every directory a mount in the node's mount namespace is made of."""
    root = f"/proc/{containerd_pid}/root"
    found = set()
    for directory in mounted_directories(Path(f"/proc/{containerd_pid}/mountinfo").read_text()):
        try:
            found.add(_identity(root + directory))
        except OSError:
            continue
    return found


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _host_path(node: Node, in_node: str) -> Path:
    if not in_node.startswith(_IN_NODE_ROOT):
        raise ValueError(f"node {node.name}: a snapshot outside its /var/lib: {in_node}")
    return node.dir / "var-lib" / in_node[len(_IN_NODE_ROOT):]


def snapshot_directories(node: Node, containerd_pid: int) -> dict[str, Path]:
    """``{chain ID: directory on the machine}`` of a node's committed snapshots, read through a
    short-lived view of each topmost one."""
    listing = node.ctr(containerd_pid, "snapshots", "--snapshotter", "overlayfs", "ls")
    if listing.returncode != 0:
        raise RuntimeError(f"node {node.name}: ctr snapshots ls: {listing.stderr.strip()}")
    chains = committed_chains(listing.stdout)
    parents = set(chains.values())
    found: dict[str, Path] = {}
    for top in (key for key in chains if key not in parents):
        view = f"rayproof-shared-layers-{secrets.token_hex(4)}"
        made = node.ctr(containerd_pid, "snapshots", "--snapshotter", "overlayfs", "view", "--mounts", view, top)
        try:
            if made.returncode != 0:
                raise RuntimeError(f"node {node.name}: ctr snapshots view of {top}: {made.stderr.strip()}")
            chain = [top]
            while chains.get(chain[-1]):
                chain.append(chains[chain[-1]])
            directories = lower_directories(json.loads(made.stdout))
            if len(directories) != len(chain):
                raise RuntimeError(f"node {node.name}: {top} has {len(chain)} layers but its view "
                                   f"{len(directories)} directories")
            found.update((key, _host_path(node, d)) for key, d in zip(chain, directories))
        finally:
            node.ctr(containerd_pid, "snapshots", "--snapshotter", "overlayfs", "rm", view)
    return found


def share(nodes: Iterable[Node], containerd_pids: Mapping[str, int], *, only: str | None = None) -> Shared:
    """Link the files of every snapshot that several nodes hold to the first node's copy: those of every
    later node, or of node ``only`` alone (the nodes before it then only say where the first copies are)."""
    first_of: dict[str, Path] = {}
    done = Shared()
    for node in nodes:
        pid = containerd_pids[node.name]
        linking = only in (None, node.name)
        in_use = _in_use(pid) if linking else set()
        for key, directory in snapshot_directories(node, pid).items():
            if key not in first_of:
                first_of[key] = directory
            elif not linking:
                continue
            elif _identity(str(directory)) in in_use:
                done.skipped_mounted += 1
            else:
                done.add(link_identical_files(first_of[key], directory))
        if node.name == only:
            break
    return done
