"""The embedded platform's control plane: etcd, kube-apiserver, controller
manager and scheduler as local processes on loopback.

Three pieces, usable on their own:

* :class:`Supervisor` starts processes each in its own session with its own
  log file and a pidfile that records the exact command and the kernel's start
  time, and stops them by PID, verifying first that the PID still belongs to
  the process it started (``/proc/<pid>/cmdline`` and start time), so a
  recycled PID is never signalled. Because everything it needs is on disk, a
  second process (``rayproof platform down``, or a test after the starter was
  SIGKILLed) stops the same processes.
* :class:`StateFile` is the run directory's ``state.json``: ports, paths and
  phase, so ``status`` and ``down`` work from any process.
* :class:`ControlPlane` wires the four upstream programs together with the
  certificates from :mod:`clusters.embedded.pki` and waits, through
  :func:`core.waiting.wait_for`, until they are serving.

Everything binds to 127.0.0.1 on free ports chosen at start; nothing listens
on another address, and nothing is written outside the run directory.
"""
from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import yaml

from clusters.embedded import pki as pki_mod
from clusters.embedded.profile import Profile, load_profile
from core import timeouts
from core.waiting import WaitTimeout, wait_for

CLUSTER_NAME = "rayproof-embedded"
LOOPBACK = "127.0.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# How many log lines to quote when a process dies during start-up.
LOG_TAIL_LINES = 25
# Errors that mean "not serving yet" while polling an endpoint.
TRANSIENT_ERRORS = (OSError, ssl.SSLError, http.client.HTTPException, ValueError)


class ProcessDied(RuntimeError):
    """A supervised process exited while we waited for it to become ready."""


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct ports free on ``host`` right now.

    All sockets are held open until every port is chosen, so the ports are
    distinct; another program may still take one before our process binds
    it, in which case that process fails to start and says so in its log.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def fd_targets(pid: int | str) -> list[str]:
    """What process ``pid``'s open file descriptors point at (``socket:[N]``, ``anon_inode:inotify``,
    paths); none for a process that ended or that this one may not read."""
    targets = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return targets


def listening_ports(pids: Sequence[int] | None = None) -> set[int]:
    """TCP ports in LISTEN state (of ``pids`` if given), from /proc/net/tcp*.

    Read from /proc rather than psutil so it also works for processes owned by
    others and costs no extra dependency at this layer.
    """
    inodes: set[str] | None = None
    if pids is not None:
        inodes = {target[8:-1] for pid in pids for target in fd_targets(pid) if target.startswith("socket:[")}
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            next(fh, None)
            for line in fh:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "0A" and (inodes is None or parts[9] in inodes):
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


def _proc_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, session id, start time in clock ticks) of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses.
    rest = text[text.rfind(")") + 2:].split()
    return rest[0], int(rest[3]), int(rest[19])


@dataclass
class ProcRecord:
    """What the pidfile of one supervised process says."""

    name: str
    pid: int
    argv: list[str]
    # Command lines the process may legitimately show: a wrapper that execs
    # (unshare, sh) changes /proc/<pid>/cmdline but not the PID.
    argvs: list[list[str]]
    start_ticks: int
    seq: int
    log: str
    started_at: float

    def identity_ok(self) -> bool:
        """Whether ``pid`` is still this process (not exited, not recycled)."""
        stat = _proc_stat(self.pid)
        if stat is None or stat[0] in ("Z", "X") or stat[2] != self.start_ticks:
            return False
        cmdline = _proc_cmdline(self.pid)
        # While a wrapper execs, /proc/<pid>/cmdline reads empty for a moment
        # (measured: tens of samples per start of the Kueue launcher); the
        # matching start time already rules out a recycled PID then.
        return cmdline == [] or cmdline in self.argvs


@dataclass
class Supervisor:
    """Starts and stops the platform's processes, with records on disk.

    ``<run>/pids/<name>.json`` and ``<run>/logs/<name>.log`` per process.
    Stopping goes in reverse start order (``seq``).
    """

    run_dir: Path
    _popen: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    @property
    def pids_dir(self) -> Path:
        return self.run_dir / "pids"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        exec_argvs: Sequence[Sequence[str]] = (),
    ) -> ProcRecord:
        """Start ``argv`` in its own session, logging to ``logs/<name>.log``.

        ``exec_argvs`` are the command lines the process will show after a
        wrapper in ``argv`` execs (into another wrapper, then the program):
        the PID stays, the cmdline changes, and all of them identify it.
        Refuses to start a name whose previous process is still running.
        """
        old = self.record(name)
        if old is not None and old.identity_ok():
            raise RuntimeError(f"{name} is already running as PID {old.pid}")
        self.pids_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"{name}.log"
        seq = max((r.seq for r in self.records()), default=0) + 1
        with open(log_path, "ab") as log:
            log.write(f"\n=== rayproof: starting {name}: {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(cwd or self.run_dir),
                env=dict(env) if env is not None else None,
                start_new_session=True,
                close_fds=True,
            )
        stat = _proc_stat(proc.pid)
        argvs = [list(argv)] + [list(a) for a in exec_argvs]
        rec = ProcRecord(
            name=name, pid=proc.pid, argv=list(argv), argvs=argvs,
            start_ticks=stat[2] if stat else -1, seq=seq, log=str(log_path), started_at=time.time(),
        )
        self._write(rec)
        self._popen[name] = proc
        return rec

    def _write(self, rec: ProcRecord) -> None:
        path = self.pids_dir / f"{rec.name}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(rec), indent=1))
        os.replace(tmp, path)

    def record(self, name: str) -> ProcRecord | None:
        try:
            return ProcRecord(**json.loads((self.pids_dir / f"{name}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def records(self) -> list[ProcRecord]:
        out = []
        if self.pids_dir.is_dir():
            for p in self.pids_dir.glob("*.json"):
                rec = self.record(p.stem)
                if rec is not None:
                    out.append(rec)
        return sorted(out, key=lambda r: r.seq)

    def running(self, name: str) -> bool:
        rec = self.record(name)
        return rec is not None and rec.identity_ok()

    def check_alive(self, name: str) -> None:
        """Raise :class:`ProcessDied` with the log's tail if ``name`` is not running."""
        if not self.running(name):
            rec = self.record(name)
            code = self._popen[name].poll() if name in self._popen else None
            seen = ""
            if rec is not None and code is None:
                # Alive but not recognised: say what /proc shows instead.
                seen = f"; PID {rec.pid} shows stat {_proc_stat(rec.pid)}, cmdline {_proc_cmdline(rec.pid)}"
            raise ProcessDied(
                f"{name} is not running (exit status {code if code is not None else 'unknown'}{seen}); "
                f"last lines of {rec.log if rec else 'its log'}:\n{self.log_tail(name)}"
            )

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        try:
            data = (self.logs_dir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(data[-lines:])

    def session_members(self, rec: ProcRecord) -> list[int]:
        """PIDs in the session our process leads (its descendants that did
        not start sessions of their own).

        Nothing else can join a session, so a session id equal to our PID is
        ours, unless that PID was recycled by another session leader; that is
        excluded by requiring the leader to be gone or still verified ours.
        """
        leader = _proc_stat(rec.pid)
        if leader is not None and leader[0] not in ("Z", "X") and not rec.identity_ok():
            return []
        members = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != rec.pid:
                stat = _proc_stat(int(entry))
                if stat is not None and stat[1] == rec.pid and stat[0] not in ("Z", "X"):
                    members.append(int(entry))
        return members

    def stop(self, name: str) -> str | None:
        """Stop one process: SIGTERM, a grace period, then SIGKILL of it and
        of what is left in its session. Safe to repeat. Returns what was done."""
        rec = self.record(name)
        if rec is None:
            return None
        did = None
        if rec.identity_ok():
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGTERM)
            try:
                wait_for(lambda: self._gone(rec), timeout=timeouts.GRACE,
                         description=f"{name} (PID {rec.pid}) to exit after SIGTERM", interval=0.1)
                did = f"{name} (PID {rec.pid}) stopped"
            except WaitTimeout:
                if rec.identity_ok():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rec.pid, signal.SIGKILL)
                did = f"{name} (PID {rec.pid}) killed after {timeouts.GRACE.seconds:g}s"
        leftovers = self.session_members(rec)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: self._gone(rec) and not self.session_members(rec), timeout=timeouts.PROCESS_EXIT,
                 description=f"{name} (PID {rec.pid}) and its session to exit", interval=0.1)
        if leftovers:
            did = (did or f"{name} had exited") + f"; killed {len(leftovers)} left in its session"
        (self.pids_dir / f"{name}.json").unlink(missing_ok=True)
        self._popen.pop(name, None)
        return did

    def _gone(self, rec: ProcRecord) -> bool:
        proc = self._popen.get(rec.name)
        if proc is not None:
            proc.poll()  # reap our own child so it does not linger as a zombie
        return not rec.identity_ok()

    def stop_all(self) -> list[str]:
        """Stop every recorded process, last started first. One that will not
        stop does not keep the others running: all are tried, then the
        failures are raised together."""
        done, failed = [], []
        for rec in reversed(self.records()):
            try:
                what = self.stop(rec.name)
            except (OSError, WaitTimeout) as exc:
                failed.append(f"{rec.name} (PID {rec.pid}): {exc}")
                continue
            if what:
                done.append(what)
        if failed:
            raise RuntimeError("could not stop: " + "; ".join(failed) + f" (stopped: {done})")
        return done

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each running process (VmRSS), by name."""
        out = {}
        for rec in self.records():
            if not rec.identity_ok():
                continue
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{rec.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[rec.name] = int(line.split()[1]) * 1024
        return out


# --------------------------------------------------------------------------
# State file
# --------------------------------------------------------------------------


class StateFile:
    """``<run>/state.json``: everything another process needs to find the
    platform (ports, paths, versions, phase). Written atomically."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "state.json"

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def update(self, **values: Any) -> dict[str, Any]:
        data = self.read()
        data.update(values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.path)
        return data


# --------------------------------------------------------------------------
# HTTP probes and kubeconfigs
# --------------------------------------------------------------------------


def tls_context(ca_file: Path | None, client: pki_mod.CertPair | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if client is not None:
        ctx.load_cert_chain(str(client.cert), str(client.key))
    return ctx


def http_get(url: str, ctx: ssl.SSLContext | None = None, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; an HTTP error status is returned, not raised,
    so a waiter can report e.g. which readyz check still fails."""
    req = urllib.request.Request(url, headers={"User-Agent": "rayproof-embedded"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca_file: Path, client: pki_mod.CertPair, user: str) -> Path:
    """A self-contained kubeconfig (certificates embedded) for ``user``."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CLUSTER_NAME, "cluster": {
            "server": server, "certificate-authority-data": _b64(ca_file)}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": _b64(client.cert), "client-key-data": _b64(client.key)}}],
        "contexts": [{"name": f"{user}@{CLUSTER_NAME}", "context": {"cluster": CLUSTER_NAME, "user": user}}],
        "current-context": f"{user}@{CLUSTER_NAME}",
        "preferences": {},
    }
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg, fh, sort_keys=False)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------
# The control plane
# --------------------------------------------------------------------------

PROCESS_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
PORT_NAMES = ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler")


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler.

    ``binaries`` maps program names to paths (what
    :func:`clusters.embedded.build.ensure_built` returns). Ports are chosen
    at :meth:`start` and recorded in the state file; an instance made later
    from the same run directory finds them there.
    """

    def __init__(
        self,
        run_dir: Path,
        profile: Profile | Mapping[str, Any] | None = None,
        binaries: Mapping[str, Path] | None = None,
        *,
        supervisor: Supervisor | None = None,
        state: StateFile | None = None,
        advertise_address: str | None = None,
        egress_selector_config_file: Path | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self.binaries = dict(binaries or {})
        self.supervisor = supervisor or Supervisor(self.run_dir)
        self.state = state or StateFile(self.run_dir)
        self.advertise_address = advertise_address
        self.egress_selector_config_file = egress_selector_config_file
        self._pki: pki_mod.ClusterPKI | None = None

    # -- paths and addresses -------------------------------------------------

    @property
    def pki(self) -> pki_mod.ClusterPKI:
        """The control plane's PKI, created on first use (by :meth:`start`)."""
        if self._pki is None:
            self._pki = pki_mod.ensure_pki(self.run_dir / "pki")
        return self._pki

    # Read-only views of the PKI: probing a platform must never create files
    # (status after down would otherwise resurrect the run directory).
    @property
    def ca_file(self) -> Path:
        return self.run_dir / "pki" / "ca.crt"

    @property
    def admin_cert(self) -> pki_mod.CertPair:
        return pki_mod.CertPair(self.run_dir / "pki" / "admin.crt", self.run_dir / "pki" / "admin.key")

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (system:masters)."""
        return self.run_dir / "kubeconfig"

    @property
    def ports(self) -> dict[str, int]:
        return dict(self.state.read().get("ports", {}))

    @property
    def api_server_url(self) -> str:
        return f"https://{LOOPBACK}:{self.ports['apiserver']}"

    # -- start ---------------------------------------------------------------

    def start(self) -> None:
        """Start all four programs and wait until the API is usable.

        Raises :class:`ProcessDied` (with the log's tail) if one exits, or
        :class:`core.waiting.WaitTimeout` if one does not become healthy
        within ``CONTROL_PLANE_START``.
        """
        missing = [b for b in PROCESS_ORDER if b not in self.binaries]
        if missing:
            raise ValueError(f"ControlPlane needs paths of {', '.join(missing)}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ports = self.ports
        if not all(n in ports for n in PORT_NAMES):
            ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
            self.state.update(ports={**self.state.read().get("ports", {}), **ports})
        pki = self.pki
        server = f"https://{LOOPBACK}:{ports['apiserver']}"
        write_kubeconfig(self.kubeconfig, server, pki.ca_file, pki.admin, "rayproof-admin")
        write_kubeconfig(self.run_dir / "controller-manager.kubeconfig", server, pki.ca_file,
                         pki.controller_manager, "system:kube-controller-manager")
        write_kubeconfig(self.run_dir / "scheduler.kubeconfig", server, pki.ca_file,
                         pki.scheduler, "system:kube-scheduler")
        self.state.update(api_server=server, kubeconfig=str(self.kubeconfig), ca_file=str(pki.ca_file))

        # In stages, each waited for: a client started before its server is
        # ready only fills its log with connection and RBAC errors (bootstrap
        # roles appear with the API server's readiness) and backs off.
        self._start_etcd(ports)
        self._wait_components(("etcd",))
        self._start_apiserver(ports)
        self._wait_components(("etcd", "kube-apiserver"))
        self._start_controller_manager(ports)
        self._start_scheduler(ports)
        self.wait_ready()

    def _env(self) -> dict[str, str]:
        # A minimal, explicit environment: no KUBECONFIG or proxy settings of
        # the caller leak into the components.
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.run_dir), "LANG": "C.UTF-8"}

    def _start_etcd(self, ports: dict[str, int]) -> None:
        client = f"http://{LOOPBACK}:{ports['etcd_client']}"
        peer = f"http://{LOOPBACK}:{ports['etcd_peer']}"
        argv = [
            str(self.binaries["etcd"]),
            "--name", CLUSTER_NAME,
            "--data-dir", str(self.run_dir / "etcd-data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{CLUSTER_NAME}={peer}", "--initial-cluster-state", "new",
            # Plain HTTP on loopback: only this host's root reaches it, and the
            # data dies with the platform. No fsync for the same reason; it
            # keeps API writes fast on a shared, slow disk.
            "--unsafe-no-fsync",
            "--log-level", "warn",
        ]
        self.supervisor.start("etcd", argv, env=self._env())

    def _start_apiserver(self, ports: dict[str, int]) -> None:
        p = self.pki
        cp = self.profile.control_plane
        argv = [
            str(self.binaries["kube-apiserver"]),
            f"--etcd-servers=http://{LOOPBACK}:{ports['etcd_client']}",
            f"--bind-address={LOOPBACK}",
            *self._advertise_flags(),
            f"--secure-port={ports['apiserver']}",
            f"--cert-dir={self.run_dir / 'apiserver-certs'}",
            f"--tls-cert-file={p.apiserver.cert}",
            f"--tls-private-key-file={p.apiserver.key}",
            f"--client-ca-file={p.ca_file}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={p.sa_public}",
            f"--service-account-signing-key-file={p.sa_private}",
            f"--service-cluster-ip-range={pki_mod.SERVICE_CLUSTER_IP_RANGE}",
            "--authorization-mode=Node,RBAC",
            # The default plugins are always on; NodeRestriction confines each
            # node's kubelet to its own Node and its pods, as on a real cluster.
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            f"--kubelet-client-certificate={p.apiserver_kubelet_client.cert}",
            f"--kubelet-client-key={p.apiserver_kubelet_client.key}",
            f"--kubelet-certificate-authority={p.ca_file}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--proxy-client-cert-file={p.front_proxy_client.cert}",
            f"--proxy-client-key-file={p.front_proxy_client.key}",
            f"--requestheader-client-ca-file={p.front_proxy_ca.pair.cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--enable-priority-and-fairness=true",
            f"--default-not-ready-toleration-seconds={cp['notReadyTolerationSeconds']}",
            f"--default-unreachable-toleration-seconds={cp['unreachableTolerationSeconds']}",
            "--profiling=false",
        ]
        if self.egress_selector_config_file:
            # Pods and services sit behind the pod network's router namespace;
            # the API server reaches them (service/pod proxy, the nodes' kubelets)
            # through the pod network's CONNECT proxy.
            argv.append(f"--egress-selector-config-file={self.egress_selector_config_file}")
        self.supervisor.start("kube-apiserver", argv, env=self._env())

    def _advertise_flags(self) -> list[str]:
        """Where the `kubernetes` Service's endpoints point.

        Endpoints may not be loopback addresses, so on loopback alone the API
        server would log a failed sync every few seconds; the reconciler is
        then off and the Service has no endpoints. A platform whose node layer
        makes the API server reachable from pods passes ``advertise_address``
        (the embedded platform's does: the pod network router's address).
        """
        if self.advertise_address:
            return [f"--advertise-address={self.advertise_address}"]
        return [f"--advertise-address={LOOPBACK}", "--endpoint-reconciler-type=none"]

    def _component_serving(self, pair: pki_mod.CertPair, port: int, kubeconfig: Path) -> list[str]:
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--bind-address={LOOPBACK}",
            f"--secure-port={port}",
            f"--tls-cert-file={pair.cert}",
            f"--tls-private-key-file={pair.key}",
            f"--client-ca-file={self.pki.ca_file}",
            f"--requestheader-client-ca-file={self.pki.front_proxy_ca.pair.cert}",
            "--leader-elect=false",
            "--profiling=false",
        ]

    def _start_controller_manager(self, ports: dict[str, int]) -> None:
        p = self.pki
        cp = self.profile.control_plane
        argv = [
            str(self.binaries["kube-controller-manager"]),
            *self._component_serving(p.controller_manager_serving, ports["controller_manager"],
                                     self.run_dir / "controller-manager.kubeconfig"),
            f"--cluster-name={CLUSTER_NAME}",
            # Every default controller except node IPAM: each node brings its
            # own pod range (nodes/fabric.py; no --cluster-cidr to carve).
            "--controllers=*,-node-ipam-controller",
            "--allocate-node-cidrs=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p.sa_private}",
            f"--root-ca-file={p.ca_file}",
            f"--cluster-signing-cert-file={p.ca_file}",
            f"--cluster-signing-key-file={p.ca.pair.key}",
            f"--node-monitor-grace-period={cp['nodeMonitorGracePeriod']}",
        ]
        self.supervisor.start("kube-controller-manager", argv, env=self._env())

    def _start_scheduler(self, ports: dict[str, int]) -> None:
        argv = [
            str(self.binaries["kube-scheduler"]),
            *self._component_serving(self.pki.scheduler_serving, ports["scheduler"],
                                     self.run_dir / "scheduler.kubeconfig"),
        ]
        self.supervisor.start("kube-scheduler", argv, env=self._env())

    # -- readiness -----------------------------------------------------------

    def probes(self) -> dict[str, tuple[int, str]]:
        """One health observation per component: (HTTP status, body)."""
        ports = self.ports
        out: dict[str, tuple[int, str]] = {}
        if not all(n in ports for n in PORT_NAMES):
            return {name: (0, "no ports recorded in the state file") for name in PROCESS_ORDER}
        try:
            ca = tls_context(self.ca_file)
            admin = tls_context(self.ca_file, self.admin_cert)
        except TRANSIENT_ERRORS as exc:
            return {name: (0, f"no credentials: {exc}") for name in PROCESS_ORDER}
        checks = {
            "etcd": (f"http://{LOOPBACK}:{ports['etcd_client']}/health", None),
            "kube-apiserver": (f"https://{LOOPBACK}:{ports['apiserver']}/readyz", admin),
            "kube-controller-manager": (f"https://{LOOPBACK}:{ports['controller_manager']}/healthz", ca),
            "kube-scheduler": (f"https://{LOOPBACK}:{ports['scheduler']}/healthz", ca),
        }
        for name, (url, ctx) in checks.items():
            try:
                out[name] = http_get(url, ctx, timeout_s=3)
            except TRANSIENT_ERRORS as exc:
                out[name] = (0, f"{type(exc).__name__}: {exc}")
        return out

    @staticmethod
    def _probe_ok(name: str, result: tuple[int, str]) -> bool:
        status, body = result
        if name == "etcd":
            return status == 200 and '"health":"true"' in body.replace(" ", "")
        return status == 200 and body.strip() == "ok"

    def healthy(self, names: Sequence[str] = PROCESS_ORDER) -> dict[str, str]:
        """``{component: "ok" | why not}`` without waiting."""
        out = {}
        probes = self.probes()
        for name in names:
            if not self.supervisor.running(name):
                out[name] = "not running"
            elif not self._probe_ok(name, probes[name]):
                out[name] = f"unhealthy: HTTP {probes[name][0]}: {probes[name][1][:200]}"
            else:
                out[name] = "ok"
        return out

    def _wait_components(self, names: Sequence[str]) -> None:
        def observe() -> dict[str, str]:
            for name in names:
                self.supervisor.check_alive(name)
            return {k: v for k, v in self.healthy(names).items() if v != "ok"}

        wait_for(observe, lambda bad: not bad, timeout=timeouts.CONTROL_PLANE_START,
                 description=f"{', '.join(names)} to be healthy", ignore=TRANSIENT_ERRORS)

    def wait_ready(self) -> None:
        """Wait until every component is healthy and the default service
        account exists (the controllers work end to end)."""

        self._wait_components(PROCESS_ORDER)

        from kubernetes import client

        api = client.CoreV1Api(self.api_client())

        def default_sa() -> str:
            for name in PROCESS_ORDER:
                self.supervisor.check_alive(name)
            api.read_namespace("default")
            return api.read_namespaced_service_account("default", "default").metadata.name

        from kubernetes.client.exceptions import ApiException

        wait_for(default_sa, timeout=timeouts.CONTROL_PLANE_START,
                 description="namespace default and its service account default to exist",
                 ignore=(*TRANSIENT_ERRORS, ApiException))

    # -- clients -------------------------------------------------------------

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` authenticated as the admin."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def server_version(self) -> dict[str, Any]:
        status, body = http_get(f"{self.api_server_url}/version",
                                tls_context(self.ca_file, self.admin_cert))
        if status != 200:
            raise RuntimeError(f"GET /version answered {status}: {body[:200]}")
        return json.loads(body)

    # -- stop ----------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stop the four programs (reverse order). Safe to repeat, and from
        another process than the one that started them."""
        done = []
        for name in reversed(PROCESS_ORDER):
            what = self.supervisor.stop(name)
            if what:
                done.append(what)
        return done

    def pids(self) -> dict[str, int]:
        return {r.name: r.pid for r in self.supervisor.records() if r.name in PROCESS_ORDER and r.identity_ok()}


@contextlib.contextmanager
def running_control_plane(run_dir: Path, profile: Profile | None = None,
                          binaries: Mapping[str, Path] | None = None) -> Iterator[ControlPlane]:
    """A started control plane, stopped on exit whatever happened."""
    cp = ControlPlane(run_dir, profile, binaries)
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()
