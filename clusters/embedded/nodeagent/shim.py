"""The container launcher: the small program that turns a process into a container.

The node agent does not fork into namespaces itself: the agent is a threaded
Python program, and ``setns``/``unshare`` of the mount namespace refuse a
multi-threaded caller (and forking a threaded process to set up mounts in a
``preexec_fn`` can deadlock). Instead the agent starts this file as a fresh,
single-threaded interpreter (``python -I -S shim.py SPEC.json``, standard
library only, about 15 ms) which does what runc does before ``execve``:

``run`` mode (a container's main process):

1. join the container's cgroups (so every descendant is charged to the
   container's memory limit and can be found and killed through the cgroup);
2. join the pod's network namespace (``setns``) -- the pod's eth0 and IP;
3. unshare a mount and a UTS namespace, make every mount private (nothing
   leaks back to the host), set the pod's hostname;
4. mount the pod's volumes at their ``mountPath`` (bind mounts), a fresh
   ``/tmp`` (the container's writable layer), a minimal ``/dev`` with a 64 MiB
   ``/dev/shm``, the generated ``/etc/hosts``, ``/etc/resolv.conf``,
   ``/etc/hostname`` and the termination-message file;
5. ``chdir`` to ``workingDir`` and ``execvpe`` the command with the
   container's environment (PATH lookup uses the container's PATH, as runc).

``exec`` mode (probes, lifecycle hooks): join the cgroups and the network,
UTS and mount namespaces of a running container's main process, then exec.

The container's ``/`` is a tmpfs into which every top-level entry of the
host's ``/`` is bind-mounted (the processes run on the host's files: there is
no image filesystem), built under the container's scratch directory and then
``pivot_root``-ed into, the way runc enters a rootfs. A mountPath that does
not exist on the host is made without writing to the host: its deepest
existing ancestor is *shadowed* by a tmpfs into which that directory's
entries are bind-mounted back, and the missing directories are made there.

If any step fails the reason is written to ``spec["error_file"]`` and the
process exits 128, which the agent reports as ``StartError`` (exit code 128),
what containerd reports when a container cannot start.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86_64
START_ERROR_EXIT = 128
# Devices a container gets in its /dev (what runc's default spec creates),
# bound from the host's /dev; everything else there is hidden.
DEV_KEEP = ("null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "fd", "stdin", "stdout",
            "stderr", "mqueue")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)


class StartError(Exception):
    """A step of container creation failed; the message is the status message."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise StartError(f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount {source or fstype} on {target}")


def umount(target: str) -> None:
    _check(_libc.umount2(_b(target), MNT_DETACH), f"umount {target}")


def setns_path(path: str, nstype: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, nstype), f"setns {path}")
    finally:
        os.close(fd)


def join_cgroups(procs_files: list[str]) -> None:
    for path in procs_files:
        with open(path, "w") as fh:
            fh.write(str(os.getpid()))


# --------------------------------------------------------------------------
# The container's root: the host's tree, with mount points made without
# writing to the host
# --------------------------------------------------------------------------


class RootBuilder:
    """Builds the container's root under ``<scratch>/root`` and pivots into it.

    The root is a tmpfs holding binds of every top-level entry of the host's
    ``/``. Volumes are mounted at ``<root>/<mountPath>`` while their sources
    are still looked up in the untouched host tree (so a volume mounted over
    ``/tmp`` cannot hide the source of another), then ``pivot_root`` makes
    ``<root>`` the container's ``/``.
    """

    def __init__(self, scratch: str):
        self.scratch = scratch
        self.root = os.path.join(scratch, "root")
        self.count = 0

    def _stage(self) -> str:
        self.count += 1
        path = os.path.join(self.scratch, f"stage{self.count}")
        os.makedirs(path, exist_ok=True)
        return path

    def build(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        mount("tmpfs", self.root, "tmpfs", 0, "mode=755,size=16m")
        self.populate("/", self.root)

    def inside(self, path: str) -> tuple[str, list[str]]:
        """(deepest existing directory under the root, missing components below
        it) for container path ``path``, following symlinks within the root
        (an absolute link target is taken relative to the root, as runc's
        securejoin does)."""
        parts = [p for p in path.split("/") if p]
        cur = self.root
        hops = 0
        i = 0
        while i < len(parts):
            part = parts[i]
            if part == "..":
                cur = os.path.dirname(cur) if cur != self.root else cur
                i += 1
                continue
            nxt = os.path.join(cur, part)
            if os.path.islink(nxt):
                hops += 1
                if hops > 40:
                    raise StartError(f"too many symlinks resolving {path}")
                link = os.readlink(nxt)
                rest = [p for p in link.split("/") if p]
                if link.startswith("/"):
                    cur = self.root
                parts = parts[:i] + rest + parts[i + 1:]
                continue
            if not os.path.exists(nxt):
                return cur, parts[i:]
            cur = nxt
            i += 1
        return cur, []

    def populate(self, source: str, dest: str, keep: tuple[str, ...] | None = None) -> None:
        """Bind every entry of ``source`` into the (empty, writable) ``dest``."""
        for name in sorted(os.listdir(source)):
            if keep is not None and name not in keep:
                continue
            src = os.path.join(source, name)
            dst = os.path.join(dest, name)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(dst, stat.S_IMODE(st.st_mode))
                mount(src, dst, None, MS_BIND | MS_REC)
            else:
                with open(dst, "w"):
                    pass
                mount(src, dst, None, MS_BIND | MS_REC)

    def shadow(self, directory: str, keep: tuple[str, ...] | None = None, size: str = "16m") -> None:
        """Cover ``directory`` (a path under the root) with a tmpfs holding
        binds of its entries, so new names can be made there without touching
        the host."""
        if directory == self.root:
            return  # the root is a tmpfs already
        st = os.stat(directory)
        stage = self._stage()
        mount(directory, stage, None, MS_BIND | MS_REC)
        mount("tmpfs", directory, "tmpfs", MS_NOSUID, f"mode={stat.S_IMODE(st.st_mode):o},size={size}")
        os.chown(directory, st.st_uid, st.st_gid)
        self.populate(stage, directory, keep)
        umount(stage)

    def ensure(self, path: str, is_dir: bool) -> str:
        """Make container path ``path`` exist (a directory or an empty file);
        return where it is under the root."""
        base, missing = self.inside(path)
        if not missing:
            return base
        self.shadow(base)
        cur = base
        for i, part in enumerate(missing):
            cur = os.path.join(cur, part)
            if i == len(missing) - 1 and not is_dir:
                with open(cur, "w"):
                    pass
            else:
                os.mkdir(cur, 0o755)
        return cur

    def pivot(self) -> None:
        old = os.path.join(self.root, ".rayproof-old-root")
        os.mkdir(old)
        syscall = _libc.syscall
        syscall.restype = ctypes.c_long
        _check(syscall(SYS_PIVOT_ROOT, _b(self.root), _b(old)), "pivot_root")
        os.chdir("/")
        umount("/.rayproof-old-root")
        os.rmdir("/.rayproof-old-root")


def do_mounts(spec: dict) -> RootBuilder:
    root = RootBuilder(spec["scratch"])
    root.build()
    if spec.get("dev"):
        dev = root.ensure("/dev", True)
        root.shadow(dev, keep=DEV_KEEP, size="1m")
        os.mkdir(os.path.join(dev, "shm"), 0o1777)
        mount("shm", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV,
              f"mode=1777,size={spec.get('shm_size', '64m')}")
    for m in spec.get("mounts", []):
        if m["type"] == "tmpfs":
            where = root.ensure(m["target"], True)
            mount("tmpfs", where, "tmpfs", MS_NOSUID | MS_NODEV, m.get("options") or "mode=1777")
            continue
        if not os.path.exists(m["source"]):
            raise StartError(f"mount source {m['source']} for {m['target']} does not exist")
        where = root.ensure(m["target"], os.path.isdir(m["source"]))
        mount(m["source"], where, None, MS_BIND | MS_REC)
        if m.get("readonly"):
            mount(None, where, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    root.ensure(spec.get("workdir") or "/", True)
    return root


def run_container(spec: dict) -> None:
    join_cgroups(spec.get("cgroup_procs", []))
    if spec.get("netns"):
        setns_path(spec["netns"], CLONE_NEWNET)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare mount and UTS namespaces")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if spec.get("hostname"):
        socket.sethostname(spec["hostname"])
    do_mounts(spec).pivot()
    os.chdir(spec.get("workdir") or "/")


def exec_in_container(spec: dict) -> None:
    join_cgroups(spec.get("cgroup_procs", []))
    pid = spec["target_pid"]
    # The network and UTS namespaces first: joining the mount namespace moves
    # our root, after which /proc paths are still fine (proc is bound in).
    for ns, flag in (("net", CLONE_NEWNET), ("uts", CLONE_NEWUTS), ("mnt", CLONE_NEWNS)):
        setns_path(f"/proc/{pid}/ns/{ns}", flag)
    os.chdir(spec.get("workdir") or "/")


def main(argv: list[str]) -> None:
    if argv[1] == "-":
        spec = json.loads(sys.stdin.readline())
    else:
        with open(argv[1]) as fh:
            spec = json.load(fh)
    # Opened before any mount: the file's host path may be hidden inside the
    # container (a state dir under /tmp, which the container gets its own of).
    error_fd = None
    if spec.get("error_file"):
        error_fd = os.open(spec["error_file"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        if spec["mode"] == "run":
            run_container(spec)
        else:
            exec_in_container(spec)
        env = spec["env"]
        args = spec["argv"]
        if not args:
            raise StartError("no command specified")
        try:
            os.execvpe(args[0], args, env)
        except FileNotFoundError:
            raise StartError(f'exec: "{args[0]}": executable file not found in $PATH') from None
        except PermissionError:
            raise StartError(f'exec: "{args[0]}": permission denied') from None
    except (StartError, OSError) as exc:
        message = str(exc)
        if error_fd is not None:
            try:
                os.write(error_fd, message.encode())
            except OSError:
                pass
        sys.stderr.write(f"rayproof-shim: {message}\n")
        os._exit(START_ERROR_EXIT)


if __name__ == "__main__":
    main(sys.argv)
