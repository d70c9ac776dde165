"""The embedded platform: control plane + KubeRay + Kueue, brought up and
torn down as one thing.

:class:`EmbeddedPlatform` is what the CLI and the pytest fixtures use. All it
knows lives in its run directory (default ``<cache>/platform/<name>/``):
``state.json`` (phase, ports, versions, profile), ``pids/`` and ``logs/``
(one per process), ``pki/`` and the kubeconfigs. So:

* :meth:`~EmbeddedPlatform.up` is idempotent: a healthy running platform
  with the same profile, binaries and platform files is reused as it is; anything else left
  in the run directory (a crashed or killed ``up``, a different profile) is
  torn down first.
* :meth:`~EmbeddedPlatform.down` works from any process, also after the
  process that ran ``up`` was SIGKILLed: it stops every process recorded in
  ``pids/`` (verifying each PID first) and removes the run directory.
* ``up`` and ``down`` on one run directory are serialised with an advisory
  lock on its parent directory (a lock file inside would die with the
  directory it protects).

The node layer (``nodes/``: kubelet, containerd and runc per node) plugs in
through :meth:`~EmbeddedPlatform.start_process`,
:meth:`~EmbeddedPlatform.issue_node_certs` and
:meth:`~EmbeddedPlatform.register_cleanup`; see NOTES.md.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from clusters import UpgradeFailed, access
from clusters.embedded import build, machine
from clusters.embedded import pki as pki_mod
from clusters.embedded.addons import ADDON_PROCESSES, Addons
from clusters.embedded.controlplane import (
    PROCESS_ORDER,
    ControlPlane,
    ProcRecord,
    StateFile,
    Supervisor,
    listening_ports,
    write_kubeconfig,
)
from clusters.embedded.profile import Profile, load_profile
from core import timeouts
from core.waiting import WaitTimeout, wait_for

DEFAULT_NAME = "default"
BASELINE = Path(__file__).resolve().parent / "baseline.yaml"
STATE_VERSION = 1
# The same rule as the pod network's (podnet/network.py): the name prefixes
# network namespaces and interface names, which are short.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
Progress = Callable[[str], None]
UNHEALTHY = "it is unhealthy: "
OTHER_PROFILE = "it runs with a different profile"


# How often a test session's platform looks again for room beside the others.
ROOM_POLL_S = 10.0


class RoomShort(str):
    """Why a test session's platform cannot start beside the others yet (``up(wait_for_room=True)`` waits)."""


def platform_root() -> Path:
    """``<cache>/platform``: where named platforms keep their run directories."""
    return build.cache_root() / "platform"


def elsewhere_root() -> Path:
    """``<cache>/platform-elsewhere``: a link to the run directory of each
    platform kept outside :func:`platform_root` (tests' and benchmarks'
    platforms in temporary directories), from its ``up`` until its ``down``, so
    ``rayproof clean`` finds those whose owner is gone."""
    return build.cache_root() / "platform-elsewhere"


def platforms_elsewhere() -> list["EmbeddedPlatform"]:
    """The platforms :func:`elsewhere_root` links to (links to removed run directories are dropped)."""
    found = []
    for link in sorted(elsewhere_root().glob("*")) if elsewhere_root().is_dir() else []:
        if not link.is_symlink():
            continue  # not one of ours
        run_dir = Path(os.readlink(link))
        if not run_dir.is_dir():
            link.unlink(missing_ok=True)
            continue
        found.append(EmbeddedPlatform(link.name.rsplit("-", 1)[0], run_dir=run_dir))
    return found


def files_digest() -> str:
    """SHA-256 over the reference platform's own code and configuration
    (every file under ``clusters/embedded/`` that ships with the suite): a
    platform started from other files is not the one this checkout describes."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    files = sorted(p for p in here.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".toml"))
    for path in [*files, access.SHIPPED_ROLE, access.SHIPPED_PRIORITY_CLASS, access.SHIPPED_GUARD]:  # and clusters/rbac
        h.update(f"{path.relative_to(here.parents[1])}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _quiet(_message: str) -> None:
    pass


class PlatformInUse(machine.UpRefused):
    """The platform would have to be replaced, but test sessions still use it."""


class PlatformKept(machine.UpRefused):
    """A run asks for another profile than the one a user's ``rayproof up``
    started the platform with: it is theirs, and is not replaced under them."""


def pod_network_flags(profile: Profile) -> list[str]:
    """What the pod network controller (``podnet run``) does for ``profile``'s network.

    It routes between the nodes and carries the API server's egress. CoreDNS
    pods serve DNS (``nodes/dns.py``), kube-proxy in each node translates
    Service addresses and serves node ports, and kube-router judges
    NetworkPolicy in each node (``nodes/netpol.py``); the router judges it
    too only to cut connections opened before a policy, which kube-router
    keeps.
    """
    flags = ["--recheck-established" if profile.cuts_open_connections else "--no-network-policy"]
    if profile.enforces_network_policy and profile.policy_engine_nodes is not None:
        flags += ["--policy-nodes", ",".join(profile.policy_engine_nodes)]
    return flags


class EmbeddedPlatform:
    """One embedded Kubernetes platform, identified by its run directory."""

    def __init__(
        self,
        name: str = DEFAULT_NAME,
        *,
        run_dir: Path | str | None = None,
        profile: Profile | Mapping[str, Any] | str | Path | None = None,
        binaries: Mapping[str, Path] | None = None,
        progress: Progress = _quiet,
    ):
        if not NAME_RE.match(name):
            raise ValueError(f"platform name {name!r} must be 1-40 lowercase letters, digits or '-', "
                             "starting with a letter or digit")
        self.name = name
        self.run_dir = Path(run_dir) if run_dir is not None else platform_root() / name
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self._binaries = dict(binaries) if binaries else None
        self.progress = progress
        self.state = StateFile(self.run_dir)
        self.supervisor = Supervisor(self.run_dir)

    # -- what other code uses -------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters), certificates embedded."""
        return self.run_dir / "kubeconfig"

    @property
    def certifier_kubeconfig(self) -> Path:
        """Kubeconfig of the identity that certifies this platform: user
        ``rayproof-certifier``, bound to the suite's shipped ClusterRole only."""
        return self.run_dir / "certifier.kubeconfig"

    @property
    def ca_file(self) -> Path:
        """The cluster CA every component and node trusts."""
        return self.run_dir / "pki" / "ca.crt"

    @property
    def api_server_url(self) -> str:
        return str(self.state.read()["api_server"])

    @property
    def pki(self) -> pki_mod.ClusterPKI:
        """The control plane's PKI (loads what ``up`` created)."""
        if not self.ca_file.is_file():
            raise RuntimeError(f"platform {self.name} has no PKI in {self.run_dir}; run up() first")
        return pki_mod.ensure_pki(self.run_dir / "pki")

    def issue_node_certs(self, node_name: str, ip_addresses: Sequence[str] = ()) -> pki_mod.NodeCerts:
        """Serving and client certificates for a node's kubelet (``system:node:<name>``)."""
        return self.pki.issue_node(node_name, ip_addresses)

    def start_process(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        exec_argvs: Sequence[Sequence[str]] = (),
    ) -> ProcRecord:
        """Start a process that belongs to the platform (e.g. a node's kubelet):
        own session, ``logs/<name>.log``, ``pids/<name>.json``; :meth:`down`
        stops it (it was started last, so it is stopped first)."""
        return self.supervisor.start(name, argv, env=env, exec_argvs=exec_argvs)

    def register_cleanup(self, function: str, **kwargs: Any) -> None:
        """Have :meth:`down` call ``function`` (``"package.module:name"``) with
        ``kwargs`` after every process is stopped and before the run directory
        is removed, also from another process or after a crash.

        For what the platform makes outside its processes and run directory
        (network namespaces, iptables rules). ``kwargs`` must be JSON; the
        function must be idempotent (down may be repeated). Called last
        registered first.
        """
        json.dumps(kwargs)
        if self.state.read().get("phase") not in ("starting", "running"):
            raise RuntimeError(f"platform {self.name} is not up; register cleanups after up()")
        if ":" not in function:
            raise ValueError(f"cleanup {function!r} must be 'package.module:function'")
        cleanups = list(self.state.read().get("cleanups", []))
        entry = {"function": function, "kwargs": kwargs}
        if entry not in cleanups:
            self.state.update(cleanups=[*cleanups, entry])

    def api_client(self, *, certifier: bool = False) -> Any:
        """A ``kubernetes.client.ApiClient`` for the admin kubeconfig (with
        ``certifier``, for the certifying identity's)."""
        from kubernetes import config

        return config.new_client_from_config(
            config_file=str(self.certifier_kubeconfig if certifier else self.kubeconfig))

    def binaries(self) -> dict[str, Path]:
        """Paths of the pinned upstream programs (builds once if needed)."""
        if self._binaries is None:
            self._binaries = build.ensure_built(self.progress)
        return self._binaries

    def control_plane(self) -> ControlPlane:
        # Pods reach the API server at the router's address (nodes/relay.py), so it is the
        # `kubernetes` Service's endpoint.
        from clusters.embedded.podnet import ROUTER_IP

        return ControlPlane(self.run_dir, self.profile, self._binaries or {},
                            supervisor=self.supervisor, state=self.state,
                            advertise_address=ROUTER_IP,
                            egress_selector_config_file=self.run_dir / "egress-selector.yaml")

    @property
    def podnet_dir(self) -> Path:
        return self.run_dir / "podnet"

    def _start_nodes(self) -> None:
        """The node layer (``nodes/``), then wait until all nodes are Ready; then their policy engine,
        CoreDNS and the pre-pulled images."""
        from kubernetes import client

        from clusters.embedded.nodes import dns, layer, netpol, prepull

        layer.start(self, self.progress, _python_env())
        core = client.CoreV1Api(self.api_client())
        want = self.profile.node_count
        gpus = self.profile.node_shape.get("nvidia.com/gpu")  # a real node has them once its plugin registered

        def ready_nodes() -> list[str]:
            return sorted(n.metadata.name for n in core.list_node().items
                          if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                          and (gpus is None or (n.status.capacity or {}).get("nvidia.com/gpu") == gpus))

        wait_for(ready_nodes, lambda names: len(names) >= want, timeout=timeouts.NODE_READY,
                 description=f"{want} Ready nodes of platform {self.name}" + (f" with {gpus} GPUs each" if gpus else ""))
        if self.profile.enforces_network_policy:  # before any pod of the platform's own
            engine_on = self.profile.policy_engine_nodes
            netpol.start(self, [n for n in layer.nodes_of(self) if engine_on is None or n.name in engine_on],
                         self.progress)
        dns.deploy(self.api_client(), self.progress)
        prepull.deploy(self.api_client(), self.profile.prepull_images, [n.name for n in layer.nodes_of(self)],
                       self.progress, after_each_node=lambda node: layer.share_image_layers(self, node).summary())

    def _start_pod_network(self) -> None:
        """The pod network controller: the router between the nodes, the API server's way in to pods and
        kubelets, and (to cut open connections) the router's NetworkPolicy engine."""
        self.register_cleanup("clusters.embedded.podnet.network:teardown", platform=self.name,
                              state_dir=str(self.podnet_dir))
        argv = [sys.executable, "-m", "clusters.embedded.podnet", "run", "--kubeconfig", str(self.kubeconfig),
                "--platform", self.name, "--state-dir", str(self.podnet_dir)]
        self.start_process("podnet", argv + pod_network_flags(self.profile), env=_python_env())
        ready = self.podnet_dir / "controller.ready"
        wait_for(ready.exists, timeout=timeouts.OPERATORS_START,
                 description=f"pod network controller of platform {self.name} ({ready})")

    def _apply_baseline(self) -> None:
        """The Kueue objects an operator sets up for teams (``baseline.yaml``): flavor, priority classes."""
        import yaml
        from kubernetes import client

        objs = client.CustomObjectsApi(self.api_client())
        for doc in yaml.safe_load_all(BASELINE.read_text()):
            group, version = doc["apiVersion"].split("/")
            plural = doc["kind"].lower() + "es" if doc["kind"].endswith("s") else doc["kind"].lower() + "s"
            try:
                objs.create_cluster_custom_object(group, version, plural, doc)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise

    def _grant_certifier(self) -> None:
        """What a platform's admins do for whoever certifies it: apply the
        suite's ClusterRoles and PriorityClass (``clusters/rbac/``) and bind the
        certifier's role, and nothing else, to the certifying identity (a client certificate of the
        platform's CA for user ``rayproof-certifier``, in no group)."""
        import yaml
        from kubernetes import client

        pair = self.pki.ca.issue(self.run_dir / "pki", "certifier", access.ROLE_NAME, client=True)
        write_kubeconfig(self.certifier_kubeconfig, self.api_server_url, self.ca_file, pair, access.ROLE_NAME)
        rbac = client.RbacAuthorizationV1Api(self.api_client())
        for role in yaml.safe_load_all(access.SHIPPED_ROLE.read_text()):  # the certifier's and each run's
            rbac.create_cluster_role(role)
        client.SchedulingV1Api(self.api_client()).create_priority_class(
            yaml.safe_load(access.SHIPPED_PRIORITY_CLASS.read_text()))
        rbac.create_cluster_role_binding({
            "metadata": {"name": access.ROLE_NAME},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": access.ROLE_NAME},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": access.ROLE_NAME}]})
        admission = client.AdmissionregistrationV1Api(self.api_client())
        policy, binding = yaml.safe_load_all(access.SHIPPED_GUARD.read_text())
        admission.create_validating_admission_policy(policy)
        admission.create_validating_admission_policy_binding(binding)
        certifier = self.api_client(certifier=True)
        wait_for(lambda: access.write_let_through(certifier), lambda let_through: let_through is None,
                 timeout=timeouts.CONTROLLER_RECONCILE,
                 description=f"the API server of platform {self.name} to refuse {access.ROLE_NAME} a write outside "
                             f"its runs' namespaces ({access.SHIPPED_GUARD_FILE} in force)")

    def _start_onboarding(self) -> None:
        """The platform's namespace onboarding (``onboarding/``): team namespaces get their queues and policies."""
        ready = self.run_dir / "onboarding.ready"
        self.start_process("onboarding", [sys.executable, "-m", "clusters.embedded.onboarding", "run",
                                          "--kubeconfig", str(self.kubeconfig), "--ready-file", str(ready)],
                           env=_python_env())
        wait_for(ready.exists, timeout=timeouts.OPERATORS_START,
                 description=f"namespace onboarding of platform {self.name} to install its classes ({ready})")

    def addons(self) -> Addons:
        return Addons(self.control_plane(), self._binaries or {})

    # -- lifecycle -------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        parent = self.run_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.progress(f"waiting for another up/down in {parent} ...")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    @property
    def _users_dir(self) -> Path:
        return self.run_dir / "users"

    def session_users(self) -> list[int]:
        """PIDs of the live test sessions using a platform that a test session
        brought up (none for one brought up by ``rayproof up``)."""
        from core.processes import live_pids_in

        return live_pids_in(self._users_dir)

    def session_owned(self) -> bool:
        """Brought up by a test session (taken down when its last user leaves)."""
        return self._users_dir.is_dir()

    def up(self, *, session: bool = False, wait_for_room: bool = False) -> "EmbeddedPlatform":
        """Bring the platform up, or reuse it if it is already up and healthy.

        ``session``: a test session uses it. If this call brings it up, or
        another session did, this process joins its users; the last user to
        :meth:`leave` takes it down. One brought up by ``rayproof up`` has no
        users and is left running.

        ``wait_for_room`` (the project's tests): where the other embedded
        platforms on this machine leave too few inotify instances for this
        one, wait for them to go down (``timeouts.PLATFORM_ROOM``) instead of
        refusing. A test run's platforms then start as others end, however
        its workers' turns fall (a four-node platform beside another leaves
        too few of the default 128 for a third); ``rayproof up`` and
        ``certify`` refuse at once.

        On failure every started process is stopped, the run directory (with
        the logs) is kept for diagnosis with phase ``failed``, and the error
        is raised; the next ``up`` or ``down`` clears it.
        """
        if not wait_for_room:
            started = self._up(session, wait_for_room=False)
            assert isinstance(started, EmbeddedPlatform)
            return started
        said: list[str] = []

        def attempt() -> "EmbeddedPlatform | RoomShort":
            outcome = self._up(session, wait_for_room=True)
            if isinstance(outcome, RoomShort) and not said:
                said.append(outcome)
                self.progress(f"platform {self.name}: waiting for another platform to go down: {outcome}")
            return outcome

        return wait_for(attempt, lambda outcome: isinstance(outcome, EmbeddedPlatform), timeout=timeouts.PLATFORM_ROOM,
                        interval=ROOM_POLL_S, ignore=(), description=f"room on this machine for platform {self.name}")

    def _other_platforms(self) -> list[str]:
        """The other embedded platforms on this machine (named ones, and those in temporary directories)."""
        named = [d.name for d in platform_root().glob("*") if d.is_dir() and d.name != self.name]
        return sorted({*named, *(p.name for p in platforms_elsewhere() if p.name != self.name)})

    def wait_for_room(self) -> None:
        """Wait (``timeouts.PLATFORM_ROOM``), holding nothing, until this machine has room for this
        platform beside the others (inotify instances), or until it runs or starts already (its reuse is
        :meth:`up`'s to judge). A test that holds a host slot for a platform's start waits here first, so
        the slot does not stand idle while the others go down; ``up(wait_for_room=True)`` checks again."""
        def short_of_room() -> str | None:
            if self.state.read().get("phase") in ("running", "starting"):
                return None
            others = self._other_platforms()
            try:
                machine.check_inotify(self.name, self.profile.node_count, others)
            except machine.MachineUnfit as exc:
                return str(exc) if others else None  # with none to wait for, up() refuses
            return None

        wait_for(short_of_room, lambda why: why is None, timeout=timeouts.PLATFORM_ROOM, interval=ROOM_POLL_S,
                 ignore=(), description=f"room on this machine for platform {self.name}, holding nothing")

    def _up(self, session: bool, *, wait_for_room: bool) -> "EmbeddedPlatform | RoomShort":
        """:meth:`up` once: the platform, or (``wait_for_room``) why it cannot start beside the others yet."""
        from core.processes import join_users, owner_token

        with self._locked(), contextlib.ExitStack() as starting:
            binaries = self.binaries()
            reason = self._reuse_blocker(binaries)
            if reason is None:
                return self._joined(session)
            users = [pid for pid in self.session_users() if pid != os.getpid()]
            if users and reason.startswith(UNHEALTHY):  # a loaded machine's slow answer is not a dead platform
                with contextlib.suppress(WaitTimeout):
                    wait_for(lambda: self._reuse_blocker(binaries), lambda why: why is None,
                             timeout=timeouts.CONTROL_PLANE_START, interval=2,
                             description=f"platform {self.name}, used by sessions {users}, to be healthy again")
                    return self._joined(session)
                reason = self._reuse_blocker(binaries) or reason
            if session and reason == OTHER_PROFILE and not self.session_owned():
                started_with = self.state.read().get("profile_source") or "another profile"
                raise PlatformKept(
                    f"platform {self.name}, started by `rayproof up` with {started_with}, runs another platform "
                    f"profile than this run's ({self.profile.source}); it is left as it is. Name the profile it "
                    f"was started with (--platform-profile), another platform (--platform-name), or take it down "
                    f"first (`bin/rayproof down --name {self.name}`)")
            if users:
                raise PlatformInUse(f"platform {self.name} cannot be replaced ({reason}): test sessions "
                                    f"{users} still use it; wait for them to end, or stop them, then run again "
                                    f"(`bin/rayproof down --name {self.name}` takes it down under them)")
            machine.check_cgroups()  # before anything is cleared or started
            if self.run_dir.exists():
                self.progress(f"platform {self.name}: {reason}; clearing {self.run_dir}")
                self._teardown()
            # What the platform replaced held inotify instances until now. One
            # start at a time on this machine, from this check until it is up,
            # so the next one counts what this one holds.
            starting.enter_context(machine.starts_lock(self.progress))
            others = sorted(d.name for d in platform_root().glob("*") if d.is_dir() and d.name != self.name)
            try:
                machine.check_inotify(self.name, self.profile.node_count, others)
            except machine.MachineUnfit as exc:
                if wait_for_room and self._other_platforms():  # they free instances as they go down
                    return RoomShort(str(exc))
                raise
            machine.check_disk(self.name, self.profile.node_count, self.run_dir, others,
                               images_shared=bool(self.profile.prepull_images))
            self.run_dir.mkdir(parents=True)
            os.chmod(self.run_dir, 0o700)
            self._link_elsewhere()
            if session:  # recorded before anything starts: `clean` finds a session's platform killed mid-up
                join_users(self._users_dir)
            versions = build.pinned_versions()
            self.state.update(
                state_version=STATE_VERSION, name=self.name, phase="starting",
                owner_pid=os.getpid(), owner=owner_token(), started_at=time.time(),
                profile=self.profile.as_dict(), profile_digest=self.profile.digest(), profile_source=self.profile.source,
                files_digest=files_digest(),
                bin_dir=str(Path(binaries["kube-apiserver"]).parent), versions=versions,
            )
            t0 = time.monotonic()
            try:
                self.progress(f"platform {self.name}: starting the control plane in {self.run_dir}")
                from clusters.embedded.podnet import cluster_proxy_socket, egress_selector_config

                (self.run_dir / "egress-selector.yaml").write_text(
                    egress_selector_config(cluster_proxy_socket(self.podnet_dir)))
                cp = self.control_plane()
                cp.start()
                t_cp = time.monotonic() - t0
                self.progress(f"platform {self.name}: control plane up in {t_cp:.1f}s; starting KubeRay and Kueue")
                Addons(cp, binaries).start()
                self._start_pod_network()
                self._start_nodes()
                self._apply_baseline()
                self._grant_certifier()
                self._start_onboarding()
            except BaseException as exc:
                self.supervisor.stop_all()
                self.state.update(phase="failed", error=f"{type(exc).__name__}: {exc}")
                raise
            total = time.monotonic() - t0
            self.state.update(phase="running", ready_at=time.time(),
                              timings={"control_plane_s": round(t_cp, 1), "total_s": round(total, 1)})
            self.progress(f"platform {self.name}: up in {total:.1f}s; kubeconfig {self.kubeconfig}")
            return self

    def _joined(self, session: bool) -> "EmbeddedPlatform":
        """This platform, already up, reused (a session joins its users)."""
        from core.processes import join_users

        self.progress(f"platform {self.name} is already up: {self.run_dir}")
        if session and self.session_owned():
            if not self.session_users():
                self.progress(f"adopting platform {self.name}, left running by a test session that is gone")
            join_users(self._users_dir)
        return self

    def _reuse_blocker(self, binaries: Mapping[str, Path]) -> str | None:
        """Why the platform in the run directory cannot be reused (None: it can)."""
        st = self.state.read()
        if not st:
            return "no platform recorded"
        if st.get("phase") != "running":
            return f"a previous up ended in phase {st.get('phase')!r}"
        if st.get("profile_digest") != self.profile.digest():
            return OTHER_PROFILE
        if st.get("bin_dir") != str(Path(binaries["kube-apiserver"]).parent):
            return "it runs other binaries (versions.toml changed)"
        if st.get("files_digest") != files_digest():
            return "it was started from other files of the reference platform (clusters/embedded/ changed)"
        bad = {k: v for k, v in self.health().items() if v != "ok"}
        if bad:
            return UNHEALTHY + "; ".join(f"{k}: {v}" for k, v in bad.items())
        return None

    def leave(self) -> list[str]:
        """This session stops using the platform; the last live user of a
        platform a session brought up takes it down. Returns what was done.

        The last user stays recorded until the teardown is done: a pytest-xdist
        worker interrupted with its session is stopped by xdist 10 s later,
        inside the teardown of four real nodes, and the platform must then
        still be that worker's for its session's sweep (which takes down only
        what its own workers leave) to finish the job."""
        from core.processes import leave_users

        if not self.run_dir.parent.is_dir():
            return []
        with self._locked():
            others = [pid for pid in self.session_users() if pid != os.getpid()]
            done = self._teardown() if self.session_owned() and not others else []
            leave_users(self._users_dir)
            return done

    def down(self) -> list[str]:
        """Stop every process of the platform and remove its run directory.

        Safe to repeat and to run from another process or after ``up`` was
        killed. Returns what was done.
        """
        if not self.run_dir.parent.is_dir():
            return []  # never made: do not create its parent just to lock it
        with self._locked():
            return self._teardown()

    def _teardown(self) -> list[str]:
        if not self.run_dir.exists():
            return []
        done = self.supervisor.stop_all()
        failed = []
        for entry in reversed(self.state.read().get("cleanups", [])):
            module, _, attr = entry["function"].partition(":")
            try:
                if entry["function"] == NODE_AGENT_CLEANUP:
                    done.append(self._node_agent_left(Path(entry["kwargs"]["state_dir"])))
                    continue
                getattr(importlib.import_module(module), attr)(**entry["kwargs"])
                done.append(f"cleanup {entry['function']}")
            except Exception as exc:  # noqa: BLE001 - reported together below
                failed.append(f"{entry['function']}({entry['kwargs']}): {type(exc).__name__}: {exc}")
        if failed:
            # Keep the run directory: it holds what a repeated down() needs.
            raise RuntimeError(f"platform {self.name}: cleanups failed, {self.run_dir} kept: " + "; ".join(failed))
        if not (self.run_dir / "state.json").exists() and any(self.run_dir.iterdir()):
            # Never delete a directory we cannot tell is ours.
            raise RuntimeError(
                f"{self.run_dir} has no state.json: not a platform run directory; "
                "remove it yourself if it is a leftover"
            )
        shutil.rmtree(self.run_dir)
        done.append(f"removed {self.run_dir}")
        if self._elsewhere_link is not None:
            self._elsewhere_link.unlink(missing_ok=True)
        return done

    def _node_agent_left(self, state_dir: Path) -> str:
        """The cleanup of a platform an older checkout started on the retired node agent (issue 39),
        whose code is gone: nothing to do where its pods' records are gone (the agent stops its
        containers when it is stopped), else what to run."""
        left = sorted(p.name for p in (state_dir / "pods").iterdir()) if (state_dir / "pods").is_dir() else []
        if not left:
            return f"cleanup {NODE_AGENT_CLEANUP}: the retired node agent left no pod in {state_dir}"
        raise RuntimeError(
            f"platform {self.name} was started on the node agent, which this checkout no longer has, and its "
            f"records in {state_dir} name {len(left)} pods whose containers may still run: take it down with a "
            f"checkout that has it (`git worktree add /tmp/rayproof-node-agent {LAST_NODE_AGENT_COMMIT} && "
            f"/tmp/rayproof-node-agent/bin/rayproof down --name {self.name}`, or its `clean` for a test "
            "session's platform), then run down here again")

    @property
    def _elsewhere_link(self) -> Path | None:
        """This platform's link in :func:`elsewhere_root` (None: its run directory is in :func:`platform_root`)."""
        run_dir = self.run_dir.resolve()
        if run_dir.parent == platform_root().resolve():
            return None
        return elsewhere_root() / f"{self.name}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]}"

    def _link_elsewhere(self) -> None:
        """Link a run directory outside :func:`platform_root` from :func:`elsewhere_root` (before anything starts)."""
        link = self._elsewhere_link
        if link is not None:
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(self.run_dir.resolve())

    def owner_gone(self) -> bool:
        """The process that brought it up is known to have ended (False where that cannot be told)."""
        from core.processes import token_alive

        return token_alive(self.state.read().get("owner", "")) is False

    def __enter__(self) -> "EmbeddedPlatform":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- observation ---------------------------------------------------------

    def upgrade_kuberay(self, version: str, progress: Progress | None = None) -> dict[str, Any]:
        """Upgrade this running platform's KubeRay operator to ``version`` (one
        of ``build.kuberay_upgrade_versions()``, built once from its Go
        module): its CRDs applied in place, then the operator restarted on the
        new binary. The platform stays upgraded until it comes down; its state
        and ``status`` name the running version. Returns when each step ended."""
        progress = progress or self.progress
        built = build.ensure_kuberay_built(version, progress)
        with self._locked():
            st = self.state.read()
            if st.get("phase") != "running":
                raise RuntimeError(f"platform {self.name} is not running (phase {st.get('phase')!r}); nothing upgraded")
            before = (st.get("versions") or {}).get("kuberay")
            progress(f"platform {self.name}: upgrading the KubeRay operator {before} -> {version}")
            binaries = self.binaries()
            try:
                at = Addons(self.control_plane(), binaries).upgrade_kuberay(built["kuberay-operator"], built["crds"])
            except Exception as exc:  # any step of the procedure: what it did stays done
                self.state.update(kuberay_upgraded={"from": before, "to": version, "failed": str(exc)})
                raise UpgradeFailed(f"the upgrade of the KubeRay operator {before} -> {version} stopped: {exc}") from exc
            self.state.update(versions={**(st.get("versions") or {}), "kuberay": version},
                              kuberay_upgraded={"from": before, "to": version, **at})
        return {"from": before, "to": version, **at}

    def health(self) -> dict[str, str]:
        """``{component: "ok" | why not}`` for every platform process."""
        if not self.state.path.exists():
            return {name: "not running" for name in (*PROCESS_ORDER, *ADDON_PROCESSES, *self.node_layer_processes())}
        cp = self.control_plane()
        out = cp.healthy()
        out.update(Addons(cp, {}).healthy())
        for name in self.node_layer_processes():
            out[name] = "ok" if self.supervisor.running(name) else "not running"
        return out

    def node_layer_processes(self) -> tuple[str, ...]:
        """The platform's processes besides the control plane and the operators: the pod network, its
        nodes' (by its profile) and the namespace onboarding (the operators' automation for team
        namespaces), started after the addons; no health endpoint of their own: healthy while running."""
        from clusters.embedded.nodes.layer import process_names

        gpus = "nvidia.com/gpu" in self.profile.node_shape
        engines = len(self.profile.policy_engine_nodes or range(self.profile.node_count)) \
            if self.profile.enforces_network_policy else 0
        return ("podnet", *process_names(self.profile.node_count, gpus, engines), "onboarding")

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each running platform process, by name."""
        return self.supervisor.rss_bytes()

    def status(self) -> dict[str, Any]:
        """What ``rayproof platform status`` prints: phase, health, PIDs,
        ports, paths, versions and memory. Starts and changes nothing."""
        st = self.state.read()
        if not st:
            return {"name": self.name, "run_dir": str(self.run_dir), "phase": "absent", "healthy": False}
        health = self.health()
        procs = {}
        for rec in self.supervisor.records():
            procs[rec.name] = {"pid": rec.pid, "running": rec.identity_ok(), "log": rec.log,
                               "health": health.get(rec.name, "n/a")}
        rss = self.rss_bytes()
        cp_rss = sum(v for k, v in rss.items() if k in PROCESS_ORDER)
        return {
            "name": self.name,
            "run_dir": str(self.run_dir),
            "phase": st.get("phase"),
            "healthy": st.get("phase") == "running" and all(v == "ok" for v in health.values()),
            "health": health,
            "processes": procs,
            "ports": st.get("ports", {}),
            "api_server": st.get("api_server"),
            "kubeconfig": str(self.kubeconfig),
            "versions": st.get("versions", {}),
            "profile_digest": st.get("profile_digest"),
            "timings": st.get("timings", {}),
            "rss_bytes": rss,
            "control_plane_rss_bytes": cp_rss,
            "error": st.get("error"),
        }

    def listening_ports(self) -> set[int]:
        """TCP ports our processes listen on (for leak checks)."""
        return listening_ports([r.pid for r in self.supervisor.records() if r.identity_ok()])


# A platform started before the node agent retired (issue 39) registered this
# cleanup of the agent's containers; its module is gone (EmbeddedPlatform._node_agent_left).
NODE_AGENT_CLEANUP = "clusters.embedded.nodeagent.state:cleanup"
LAST_NODE_AGENT_COMMIT = "7aa57c0"  # main where its retirement branched off: the agent is there


def _python_env() -> dict[str, str]:
    """Environment for the platform's own Python processes: this checkout importable, no phoning home."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m clusters.embedded.platform up|down|status [--name N] [--profile F]``: exit 0 done,
    1 failed, 2 bad input (a name or profile that cannot be, nothing touched)."""
    parser = argparse.ArgumentParser(
        prog="python -m clusters.embedded.platform",
        description="Run the embedded Kubernetes platform (control plane, KubeRay, Kueue).")
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--name", default=DEFAULT_NAME, help="platform name (default %(default)s)")
    parser.add_argument("--run-dir", default=None, help="run directory (default <cache>/platform/<name>)")
    parser.add_argument("--profile", default=None, help="profile YAML merged over clusters/embedded/profile.yaml")
    parser.add_argument("--wait-for-room", action="store_true",
                        help="up: wait for other platforms to leave this machine room instead of refusing (tests)")
    args = parser.parse_args(argv)
    log: Progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        p = EmbeddedPlatform(args.name, run_dir=args.run_dir, profile=args.profile, progress=log)
    except (ValueError, FileNotFoundError) as exc:  # a bad name or profile: nothing was touched
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "up":
            p.up(wait_for_room=args.wait_for_room)
            kubectl = p.binaries()["kubectl"]
            print(f"kubeconfig: {p.kubeconfig}")
            print(f"kubectl:    {kubectl} (Kubernetes {build.load_versions()['kubernetes']['version']}, as the "
                  "control plane); in a shell:")
            print(f"export KUBECONFIG={p.kubeconfig}")
            print(f"alias kubectl={kubectl}")
        elif args.command == "down":
            for line in p.down():
                print(line)
        else:
            print(json.dumps(p.status(), indent=2, default=str))
    except (RuntimeError, ValueError, WaitTimeout) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
