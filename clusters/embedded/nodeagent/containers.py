"""The container runtime: start, watch, signal and exec into container processes.

One :class:`ContainerInstance` is one start of one container (a restart is a
new instance, as with containerd): its own memory cgroup (``limits.memory``,
or unlimited), its own scratch directory (``/tmp``, the root it pivots into),
its own log file, and a main process started through ``shim.py`` in the pod's
network namespace and its own mount and UTS namespaces.

The main process plays the part of the container's PID 1: when it exits the
container has exited, and whatever it left behind in the cgroup is SIGKILLed
(what the kernel does to a PID namespace whose init dies). The exit is
classified as containerd does: ``OOMKilled`` when the cgroup recorded an OOM
kill, ``Completed`` for exit 0, ``Error`` otherwise, ``StartError`` (exit 128)
when the shim could not create the container; a signal death is exit code
128+signal.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clusters.embedded.nodeagent import state as st
from core import timeouts
from core.cgroups import CgroupUnavailable, MemoryCgroup
from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for

SHIM = Path(__file__).resolve().parent / "shim.py"
START_ERROR_EXIT = 128
# The runtime caps the termination message (kubelet: 4096 bytes; logs fallback 80 lines / 2048 bytes).
TERMINATION_MESSAGE_MAX = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
# kubelet's minimumGracePeriodInSeconds: a kill never gives less than this.
MINIMUM_GRACE_S = 2


# How often a container's v1 memory cgroup is checked for an OOM kill.
OOM_WATCH_INTERVAL_S = 0.25


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def grace_tier(seconds: float) -> Tier:
    """A pod's termination grace period as a wait tier (override with
    ``RAYPROOF_TIMEOUT_TERMINATION_GRACE_PERIOD`` to clamp every grace period)."""
    return Tier("termination_grace_period", max(float(seconds), 0.1),
                "terminationGracePeriodSeconds of a container being stopped")


def host_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 1 << 40


@dataclass
class ExitStatus:
    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    message: str = ""
    signal: int | None = None


@dataclass
class LaunchSpec:
    """Everything the shim needs to create one container instance."""

    argv: list[str]
    env: dict[str, str]
    workdir: str
    hostname: str
    netns: str | None  # name under /run/netns, or None for the host network
    mounts: list[dict[str, Any]]
    memory_limit: int | None
    termination_message_path: str = "/dev/termination-log"
    termination_message_policy: str = "File"
    extra: dict[str, Any] = field(default_factory=dict)


class ContainerInstance:
    """One running (or finished) start of a container."""

    def __init__(self, runtime: "Runtime", pod_uid: str, name: str, restart: int, base_dir: Path,
                 log_path: Path, on_exit: Callable[["ContainerInstance"], None]):
        self.runtime = runtime
        self.pod_uid = pod_uid
        self.name = name
        self.restart = restart
        self.dir = base_dir
        self.log_path = log_path
        self.on_exit = on_exit
        self.container_id = hashlib.sha256(f"{pod_uid}/{name}/{restart}/{os.urandom(8).hex()}".encode()).hexdigest()
        self.cgroup: MemoryCgroup | None = None
        self.popen: subprocess.Popen | None = None
        self.started_at: str = ""
        self.exit: ExitStatus | None = None
        self.exited = threading.Event()
        self.stopping_reason: str | None = None
        self.record: st.ContainerRecord | None = None
        self.spec: LaunchSpec | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def running(self) -> bool:
        return self.popen is not None and not self.exited.is_set()

    # -- start ------------------------------------------------------------------

    def start(self, spec: LaunchSpec) -> None:
        """Create the cgroup, write the records, start the shim. Returns when the
        process exists; a start failure is reported through the exit status."""
        self.spec = spec
        self.dir.mkdir(parents=True, exist_ok=True)
        scratch = self.dir / "scratch"
        tmp = self.dir / "tmp"
        scratch.mkdir(exist_ok=True)
        tmp.mkdir(exist_ok=True)
        os.chmod(tmp, 0o1777)
        term = self.dir / "termination-log"
        term.write_text("")
        limit = spec.memory_limit if spec.memory_limit else host_memory_bytes()
        cg_name = f"{self.pod_uid[:8]}-{self.name}-{self.restart}-{self.container_id[:6]}"
        self.cgroup = MemoryCgroup(self.runtime.cgroup_parent, cg_name, limit)
        self.record = st.ContainerRecord(self.pod_uid, self.name, self.restart, [str(self.cgroup.path)])
        self.record.save(self.runtime.state_dir)
        mounts = [{"type": "bind", "source": str(tmp), "target": "/tmp"}]
        mounts += spec.mounts
        mounts.append({"type": "bind", "source": str(term), "target": spec.termination_message_path})
        error_file = self.dir / "start-error"
        shim_spec = {
            "mode": "run",
            "cgroup_procs": [str(self.cgroup.path / "cgroup.procs")],
            "netns": f"/run/netns/{spec.netns}" if spec.netns else None,
            "hostname": spec.hostname,
            "scratch": str(scratch),
            "dev": True,
            "mounts": mounts,
            "workdir": spec.workdir,
            "env": spec.env,
            "argv": spec.argv,
            "error_file": str(error_file),
        }
        spec_path = self.dir / "spec.json"
        spec_path.write_text(json.dumps(shim_spec, indent=1))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-I", "-S", str(SHIM), str(spec_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                start_new_session=True, close_fds=True,
            )
        self.started_at = now_rfc3339()
        self.record.pid = self.popen.pid
        self.record.start_ticks = st.proc_start_ticks(self.popen.pid)
        self.record.save(self.runtime.state_dir)
        threading.Thread(target=self._reap, name=f"reap-{self.name}-{self.restart}", daemon=True).start()
        if spec.memory_limit and not self.cgroup.kill_group_on_oom():
            threading.Thread(target=self._oom_group, name=f"oom-{self.name}-{self.restart}", daemon=True).start()

    def _oom_group(self) -> None:
        """``memory.oom.group`` on cgroup v1: once the kernel OOM-kills any
        process of the container, kill the rest, so the container ends
        ``OOMKilled`` as under kubelet >= 1.28 on cgroup v2 (instead of living on
        without the killed process)."""
        assert self.cgroup is not None
        # Event.wait is the poll interval; the container's exit ends the watch.
        while not self.exited.wait(OOM_WATCH_INTERVAL_S):
            with contextlib.suppress(OSError, ValueError):
                if self.cgroup.oom_kills() > 0:
                    self.kill_all(signal.SIGKILL)
                    return

    def _reap(self) -> None:
        """Wait for the main process (blocking waitpid: an event, not a poll),
        then classify the exit and clear the cgroup."""
        assert self.popen is not None and self.cgroup is not None
        rc = self.popen.wait()
        finished = now_rfc3339()
        sig = -rc if rc < 0 else None
        code = 128 + sig if sig else rc
        oom = 0
        with contextlib.suppress(OSError, ValueError):
            oom = self.cgroup.oom_kills()
        start_error = ""
        with contextlib.suppress(OSError):
            start_error = (self.dir / "start-error").read_text().strip()
        # The container's PID 1 is gone: nothing else of it may live on.
        self.kill_all(signal.SIGKILL)
        try:
            wait_for(lambda: self.cgroup.pids(), lambda p: not p, timeout=timeouts.PROCESS_EXIT,
                     description=f"processes of container {self.name} to exit after its main process", interval=0.1)
        except WaitTimeout:
            pass
        with contextlib.suppress(OSError):
            self.cgroup.remove()
        if start_error:
            status = ExitStatus(START_ERROR_EXIT, "StartError", self.started_at, finished, start_error)
        elif oom:
            status = ExitStatus(code, "OOMKilled", self.started_at, finished, signal=sig)
        else:
            status = ExitStatus(code, "Completed" if code == 0 else "Error", self.started_at, finished, signal=sig)
        if not status.message:
            status.message = self._termination_message(code)
        self.exit = status
        self.exited.set()
        try:
            self.on_exit(self)
        except Exception:  # noqa: BLE001 - the pod worker logs its own errors
            pass

    def _termination_message(self, code: int) -> str:
        assert self.spec is not None
        msg = ""
        with contextlib.suppress(OSError):
            msg = (self.dir / "termination-log").read_text(errors="replace")[:TERMINATION_MESSAGE_MAX]
        if not msg and code != 0 and self.spec.termination_message_policy == "FallbackToLogsOnError":
            with contextlib.suppress(OSError):
                with open(self.log_path, "rb") as fh:
                    fh.seek(0, os.SEEK_END)
                    size = fh.tell()
                    fh.seek(max(0, size - FALLBACK_LOG_BYTES))
                    tail = fh.read().decode(errors="replace")
                msg = "\n".join(tail.splitlines()[-FALLBACK_LOG_LINES:])
        return msg

    # -- signals ----------------------------------------------------------------

    def kill_all(self, sig: int) -> None:
        """Signal every process of the container (its cgroup and its process group)."""
        pids = set(self.cgroup.pids()) if self.cgroup else set()
        if self.popen is not None and not self.exited.is_set():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self, grace_s: float, reason: str = "Killing") -> ExitStatus | None:
        """SIGTERM the container's main process, wait up to the grace period
        (at least 2 s, as the kubelet), then SIGKILL what is left; return the exit.

        Only the main process gets SIGTERM, as only PID 1 of a container does
        from the runtime: a program such as ``ray start --block`` shuts its
        children down in order on SIGTERM, and signalling them all at once
        (the whole process group) makes Ray hang until the SIGKILL. Whatever
        outlives the main process is SIGKILLed by the reaper.
        """
        if self.popen is None:
            return None
        self.stopping_reason = reason
        if not self.exited.is_set():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                wait_for(lambda: self.exited.is_set(), timeout=grace_tier(max(grace_s, MINIMUM_GRACE_S)),
                         description=f"container {self.name} to exit after SIGTERM", interval=0.1)
            except WaitTimeout:
                self.kill_all(signal.SIGKILL)
        with contextlib.suppress(WaitTimeout):
            wait_for(lambda: self.exited.is_set(), timeout=timeouts.PROCESS_EXIT,
                     description=f"container {self.name} to be reaped after SIGKILL", interval=0.1)
        return self.exit

    # -- exec -------------------------------------------------------------------

    def exec(self, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
        """Run ``argv`` inside this container (its namespaces and cgroup), with
        the container's environment; (exit code or None on timeout, output)."""
        if not self.running or self.spec is None or self.cgroup is None:
            return None, "container is not running"
        spec = {
            "mode": "exec",
            "cgroup_procs": [str(self.cgroup.path / "cgroup.procs")],
            "target_pid": self.popen.pid,
            "workdir": self.spec.workdir,
            "env": env if env is not None else self.spec.env,
            "argv": argv,
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SHIM), "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            start_new_session=True, close_fds=True,
        )
        try:
            out, _ = proc.communicate(json.dumps(spec).encode() + b"\n", timeout=timeout_s)
            return proc.returncode, out.decode(errors="replace")[-10240:]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            return None, f"command timed out after {timeout_s:g}s"


class Runtime:
    """Creates container instances for one agent (all its nodes)."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.cgroup_parent = st.cgroup_parent_name(state_dir)

    def check(self) -> None:
        """Fail early, with what to do, if containers cannot be made here."""
        if os.geteuid() != 0:
            raise CgroupUnavailable("the node agent runs containers in namespaces and cgroups: run it as root")
        probe = MemoryCgroup(self.cgroup_parent, f"probe-{os.getpid()}", 1 << 30)
        probe.remove()

    def new_instance(self, pod_uid: str, name: str, restart: int, pod_dir: Path,
                     on_exit: Callable[[ContainerInstance], None]) -> ContainerInstance:
        base = pod_dir / "containers" / name / str(restart)
        log = pod_dir / "logs" / name / f"{restart}.log"
        return ContainerInstance(self, pod_uid, name, restart, base, log, on_exit)
