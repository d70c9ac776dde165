"""The pod worker: one thread per pod, driving it the way the kubelet's pod worker does.

Each :class:`PodWorker` owns one pod bound to its node. Its sync loop wakes on
a pod update from the watch, a container exit, a probe result or a back-off
deadline (an ``Event.wait`` with the next deadline as timeout), and each sync:

1. if the pod is being deleted (``deletionTimestamp``) or is gone from the
   API: stops every container -- preStop hook, SIGTERM, the grace period,
   SIGKILL -- then removes network, volumes and cgroups, and for a graceful
   deletion deletes the pod with ``gracePeriodSeconds=0`` (the kubelet's
   final step that makes the API object disappear);
2. sets up the sandbox: the pod network (``attach`` -> netns + IP), the
   generated ``/etc/hosts``, ``/etc/resolv.conf``, ``/etc/hostname``, and the
   volumes (a failure is a ``FailedMount`` event and a retry);
3. runs init containers one at a time in order, each to exit 0 (a failure
   restarts it with back-off, or fails the pod under ``restartPolicy: Never``);
   restartable init containers (native sidecars) are started and left running;
4. starts the containers and restarts exited ones per ``restartPolicy`` with
   the kubelet's crash-loop back-off (10 s doubling to 300 s, reset after 10
   minutes; the first restart is immediate) shown as ``CrashLoopBackOff``;
5. kills containers whose liveness or startup probe failed (restart per policy);
6. computes the status (phase, conditions, container statuses) and writes it
   through the ``status`` subresource when it changed.

Image pulls come from the catalog (``catalog.py``); a failed pull shows
``ErrImagePull`` then ``ImagePullBackOff`` with the same back-off.
"""
from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import logging
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from clusters.embedded.nodeagent import catalog
from clusters.embedded.nodeagent import state as st
from clusters.embedded.nodeagent import status as pod_status
from clusters.embedded.nodeagent.containers import ContainerInstance, LaunchSpec, Runtime
from clusters.embedded.nodeagent.envvars import ContainerConfigError, command_line, container_env, service_env
from clusters.embedded.nodeagent.events import EventRecorder
from clusters.embedded.nodeagent.kube import ApiError, KubeClient
from clusters.embedded.nodeagent.probes import ProbeWorker, run_probe
from clusters.embedded.nodeagent.resources import memory_limit_bytes
from clusters.embedded.nodeagent.volumes import PodVolumes, VolumeError
from core.ray_agent import favour_dashboard_agent_while_starting

log = logging.getLogger(__name__)

BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
# Retry period after a sync error (the kubelet's workerBackOffPeriod).
SYNC_RETRY_S = 10.0
# A sync after ErrImagePull shows ImagePullBackOff soon, as the pod worker's requeue does.
PULL_STATUS_RESYNC_S = 2.0
# Volume contents (ConfigMaps, Secrets, tokens) are re-read this often.
VOLUME_RESYNC_S = 60.0
DEFAULT_GRACE_S = 30
CLUSTER_DOMAIN = "cluster.local"
HOSTS_HEADER = """# Kubernetes-managed hosts file.
127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
fe00::0\tip6-mcastprefix
fe00::1\tip6-allnodes
fe00::2\tip6-allrouters
"""


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()


class PodNetworkLike(Protocol):
    """What the node agent needs of the pod network (``clusters.embedded.podnet.PodNetwork``)."""

    def attach(self, pod_key: str) -> Any: ...  # -> object with .netns and .ip

    def detach(self, pod_key: str) -> None: ...

    def resolv_conf(self, namespace: str) -> str: ...


class Backoff:
    """The kubelet's ``flowcontrol.Backoff`` for one container (or one image)."""

    def __init__(self, initial: float = BACKOFF_INITIAL_S, cap: float = BACKOFF_MAX_S):
        self.initial = initial
        self.cap = cap
        self.duration: float | None = None
        self.last_update: float = 0.0

    def in_backoff_since(self, event_time: float, now: float) -> bool:
        return self.duration is not None and now - event_time < self.duration

    def next(self, event_time: float) -> None:
        # Expired after 2x the cap without a new event (10 minutes): start over.
        if self.duration is None or event_time - self.last_update > 2 * self.cap:
            self.duration = self.initial
        else:
            self.duration = min(self.duration * 2, self.cap)
        self.last_update = event_time

    def deadline(self, event_time: float) -> float:
        return event_time + (self.duration or 0.0)


@dataclass
class NodeContext:
    """What every pod worker of one node shares."""

    name: str
    host_ip: str
    api: KubeClient
    events: EventRecorder
    runtime: Runtime
    podnet: PodNetworkLike | None
    state_dir: Path
    allocatable: dict[str, str]
    tools_dir: str
    images: set[str] = field(default_factory=set)  # images "present" on this node
    pull_lock: threading.Lock = field(default_factory=threading.Lock)  # serialised pulls, as upstream's default
    forget: Callable[[str], None] = lambda uid: None


@dataclass
class ContainerState:
    """Everything the worker knows about one container of the pod, across restarts."""

    spec: dict[str, Any]
    init: bool
    instance: ContainerInstance | None = None
    last_terminated: dict[str, Any] | None = None
    waiting: tuple[str, str] | None = None
    backoff: Backoff = field(default_factory=Backoff)
    pull_backoff: Backoff = field(default_factory=Backoff)
    pull_failed_at: float | None = None
    retry_at: float | None = None  # wall-clock time of the next attempt to start
    image: catalog.Image | None = None
    probes: dict[str, ProbeWorker] = field(default_factory=dict)
    kill_reason: str | None = None  # set by a probe thread: liveness/startup failed

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def sidecar(self) -> bool:
        return self.init and pod_status.is_sidecar(self.spec)

    @property
    def running(self) -> bool:
        return self.instance is not None and self.instance.running

    @property
    def started(self) -> bool:
        if not self.running:
            return False
        sp = self.probes.get("startup")
        return sp is None or sp.result is True

    @property
    def ready(self) -> bool:
        if not self.started:
            return False
        rp = self.probes.get("readiness")
        return rp is None or rp.result is True

    def stop_probes(self) -> None:
        for p in self.probes.values():
            p.stop()
        self.probes.clear()


def terminated_dict(inst: ContainerInstance) -> dict[str, Any]:
    assert inst.exit is not None
    d: dict[str, Any] = {"exitCode": inst.exit.exit_code, "reason": inst.exit.reason,
                         "startedAt": inst.exit.started_at, "finishedAt": inst.exit.finished_at,
                         "containerID": f"rayproof://{inst.container_id}"}
    if inst.exit.message:
        d["message"] = inst.exit.message
    return d


def pod_hostname(pod: Mapping[str, Any]) -> tuple[str, str | None]:
    """(hostname, FQDN or None), as the kubelet derives them (63-character cap)."""
    spec, meta = pod.get("spec") or {}, pod["metadata"]
    host = (spec.get("hostname") or meta["name"])[:63].rstrip("-.")
    fqdn = None
    if spec.get("subdomain"):
        fqdn = f"{host}.{spec['subdomain']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"
    return host, fqdn


class PodWorker:
    """Drives one pod on one node."""

    def __init__(self, node: NodeContext, pod: dict[str, Any]):
        self.node = node
        self.uid: str = pod["metadata"]["uid"]
        self.pod = pod
        self.lock = threading.RLock()
        self.removed = False
        self._wake = threading.Event()
        self._abort = threading.Event()  # deletion or agent stop: cut pulls and waits short
        self._stopping_agent = False
        self.dir = node.state_dir / "pods" / self.uid
        spec = pod.get("spec") or {}
        self.init_states = [ContainerState(c, True) for c in spec.get("initContainers") or []]
        self.app_states = [ContainerState(c, False) for c in spec.get("containers") or []]
        self.record = st.PodRecord(self.uid, pod["metadata"]["namespace"], pod["metadata"]["name"], node.name,
                                   self.pod_key)
        self.attachment: Any = None
        self.pod_ip: str | None = None
        self.volumes: PodVolumes | None = None
        self.sandbox_ready = False
        self.initialized = False
        self.terminal_phase: str | None = None
        self._terminal_done = False
        self.pod_reason: tuple[str, str] | None = None
        self.terminating = False
        self.start_time: str | None = None
        self.last_published: dict[str, Any] | None = None
        self.next_volume_refresh = 0.0
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"pod-{self.namespace}-{self.name}", daemon=True)

    # -- identity -------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.pod["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def pod_key(self) -> str:
        """The pod network's key: ``<namespace>/<name>/<uid>``."""
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}/{self.uid}"

    @property
    def spec(self) -> dict[str, Any]:
        return self.pod.get("spec") or {}

    def states(self) -> list[ContainerState]:
        return self.init_states + self.app_states

    def state_of(self, container: str) -> ContainerState | None:
        return next((c for c in self.states() if c.name == container), None)

    # -- inputs from other threads ----------------------------------------------

    def start(self) -> "PodWorker":
        self.thread.start()
        return self

    def update(self, pod: dict[str, Any]) -> None:
        """A newer version of the pod from the watch."""
        with self.lock:
            self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self._abort.set()
        self._wake.set()

    def remove(self) -> None:
        """The pod is gone from the API (force deletion, or our own final delete)."""
        with self.lock:
            self.removed = True
        self._abort.set()
        self._wake.set()

    def stop_for_agent(self) -> None:
        """The agent is stopping: kill everything now, delete nothing in the API."""
        self._stopping_agent = True
        self.remove()

    def wake(self) -> None:
        self._wake.set()

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        timeout = 0.0
        while True:
            self._wake.wait(timeout)  # sleep-ok: pod worker pacing; woken by watch, exits, probes, deadlines
            self._wake.clear()
            try:
                if self.sync():
                    break
                timeout = self._next_wake()
            except Exception:  # noqa: BLE001 - a sync error must not kill the worker; retried like upstream
                log.error("pod %s/%s: sync failed:\n%s", self.namespace, self.name, traceback.format_exc())
                timeout = SYNC_RETRY_S
        self.finished.set()
        self.node.forget(self.uid)

    def _next_wake(self) -> float:
        now = time.time()
        # Nothing pending: still resync now and then, as the kubelet's periodic sync.
        deadlines = [now + VOLUME_RESYNC_S]
        if self.sandbox_ready:
            deadlines.append(self.next_volume_refresh)
        for cs in self.states():
            if cs.retry_at is not None:
                deadlines.append(cs.retry_at)
        ads = self.spec.get("activeDeadlineSeconds")
        if ads and self.start_time and not self.terminal_phase:
            deadlines.append(parse_time(self.start_time) + float(ads))
        return max(0.05, min(deadlines) - now)

    def sync(self) -> bool:
        """One pass; True when the worker is done (pod gone and cleaned up)."""
        with self.lock:
            pod, removed = self.pod, self.removed
        if removed or pod["metadata"].get("deletionTimestamp"):
            self.terminate(graceful=not removed)
            return True
        if self.start_time is None:
            self.start_time = (pod.get("status") or {}).get("startTime") or now_rfc3339()
        if self.terminal_phase:
            self.finish_terminal()
            self.publish()
            return False
        if self._deadline_exceeded():
            return False
        if not self.sandbox_ready and not self.setup_sandbox():
            self.publish()
            return False
        self.refresh_volumes()
        for cs in self.states():
            if cs.running and cs.kill_reason:
                self.kill_for_probe(cs)
        if not self.initialized:
            self.run_init_containers()
        if self.initialized and not self.terminal_phase:
            for cs in [c for c in self.init_states if c.sidecar] + self.app_states:
                self.ensure_running(cs)
        self.publish()
        if self.terminal_phase:
            self.finish_terminal()
        return False

    # -- sandbox ----------------------------------------------------------------------

    def setup_sandbox(self) -> bool:
        """Network, /etc files and volumes; False (with the reason recorded) when not yet possible."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.record.save(self.node.state_dir)
        if self.attachment is None:
            if self.spec.get("hostNetwork"):
                self.pod_ip = self.node.host_ip
                self.attachment = False
            else:
                if self.node.podnet is None:
                    raise RuntimeError("no pod network: the node agent needs a podnet to run pods")
                try:
                    self.attachment = self.node.podnet.attach(self.pod_key)
                except Exception as exc:  # noqa: BLE001 - shown as the pod's sandbox error
                    self._set_all_waiting("ContainerCreating", "")
                    self.node.events.pod_event(self.pod, "Warning", "FailedCreatePodSandBox",
                                               f"Failed to create pod sandbox: {exc}")
                    self._retry_all(SYNC_RETRY_S)
                    return False
                self.pod_ip = self.attachment.ip
                self.record.netns = self.attachment.netns
                self.record.ip = self.pod_ip
                self.record.save(self.node.state_dir)
        self.write_etc_files()
        if self.volumes is None:
            self.volumes = PodVolumes(self.pod, self.dir, self.node.state_dir, self.node.api,
                                      host_ip=self.node.host_ip, allocatable=self.node.allocatable,
                                      pod_ip=lambda: self.pod_ip)
        try:
            self.volumes.setup()
        except VolumeError as exc:
            self.record.host_mounts = list(self.volumes.host_mounts)
            self.record.save(self.node.state_dir)
            self._set_all_waiting("ContainerCreating", "")
            self.node.events.pod_event(self.pod, "Warning", "FailedMount", str(exc))
            self._retry_all(SYNC_RETRY_S)
            return False
        self.record.host_mounts = list(self.volumes.host_mounts)
        self.record.save(self.node.state_dir)
        self.next_volume_refresh = time.time() + VOLUME_RESYNC_S
        self.sandbox_ready = True
        for cs in self.states():
            cs.retry_at = None
            if cs.waiting and cs.waiting[0] == "ContainerCreating":
                cs.waiting = None
        return True

    @property
    def netns(self) -> str | None:
        return self.attachment.netns if self.attachment else None

    def write_etc_files(self) -> None:
        etc = self.dir / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        host, fqdn = pod_hostname(self.pod)
        if self.spec.get("setHostnameAsFQDN") and fqdn:
            host = fqdn
        lines = HOSTS_HEADER
        names = f"{fqdn}\t{host.split('.')[0]}" if fqdn else host
        lines += f"{self.pod_ip}\t{names}\n"
        aliases = self.spec.get("hostAliases") or []
        if aliases:
            lines += "\n# Entries added by HostAliases.\n"
            for a in aliases:
                lines += f"{a['ip']}\t{chr(9).join(a.get('hostnames') or [])}\n"
        (etc / "hosts").write_text(lines)
        (etc / "hostname").write_text(host + "\n")
        (etc / "resolv.conf").write_text(self.resolv_conf())

    def resolv_conf(self) -> str:
        policy = self.spec.get("dnsPolicy") or "ClusterFirst"
        host_net = bool(self.spec.get("hostNetwork"))
        cluster = policy == "ClusterFirstWithHostNet" or (policy == "ClusterFirst" and not host_net)
        if policy == "None":
            base = {"nameservers": [], "searches": [], "options": []}
        elif cluster and self.node.podnet is not None:
            base = _parse_resolv(self.node.podnet.resolv_conf(self.namespace))
        else:
            try:
                base = _parse_resolv(Path("/etc/resolv.conf").read_text())
            except OSError:
                base = {"nameservers": [], "searches": [], "options": []}
        cfg = self.spec.get("dnsConfig") or {}
        base["nameservers"] = (base["nameservers"] + list(cfg.get("nameservers") or []))[:3]
        base["searches"] = list(dict.fromkeys(base["searches"] + list(cfg.get("searches") or [])))[:32]
        opts = {o.split(":")[0]: o for o in base["options"]}
        for o in cfg.get("options") or []:
            opts[o["name"]] = o["name"] + (f":{o['value']}" if o.get("value") is not None else "")
        out = ""
        if base["searches"]:
            out += "search " + " ".join(base["searches"]) + "\n"
        for ns in base["nameservers"]:
            out += f"nameserver {ns}\n"
        if opts:
            out += "options " + " ".join(opts.values()) + "\n"
        return out

    def refresh_volumes(self) -> None:
        if self.volumes is not None and time.time() >= self.next_volume_refresh:
            with self.lock:
                self.volumes.pod = self.pod
            self.volumes.refresh()
            self.next_volume_refresh = time.time() + VOLUME_RESYNC_S

    def _set_all_waiting(self, reason: str, message: str) -> None:
        for cs in self.states():
            if cs.instance is None:
                cs.waiting = (reason, message)

    def _retry_all(self, seconds: float) -> None:
        at = time.time() + seconds
        for cs in self.states():
            cs.retry_at = at

    # -- containers -------------------------------------------------------------------

    def run_init_containers(self) -> None:
        restart_policy = self.spec.get("restartPolicy") or "Always"
        for cs in self.init_states:
            if cs.sidecar:
                if cs.running and cs.started:
                    continue
                if not cs.running:
                    self.ensure_running(cs)
                return
            inst = cs.instance
            if inst is None:
                self.start_container(cs)
                return
            if inst.running:
                return
            assert inst.exit is not None
            if inst.exit.exit_code == 0:
                continue
            if restart_policy == "Never":
                self.become_terminal("Failed")
                return
            self.restart_with_backoff(cs)
            return
        self.initialized = True
        for cs in self.app_states:
            if cs.waiting and cs.waiting[0] == "PodInitializing":
                cs.waiting = None

    def should_restart(self, cs: ContainerState) -> bool:
        if cs.sidecar:
            return True
        assert cs.instance is not None and cs.instance.exit is not None
        policy = self.spec.get("restartPolicy") or "Always"
        if cs.init:
            return policy != "Never" and cs.instance.exit.exit_code != 0
        return policy == "Always" or (policy == "OnFailure" and cs.instance.exit.exit_code != 0)

    def ensure_running(self, cs: ContainerState) -> None:
        if cs.running:
            return
        if cs.instance is None:
            self.start_container(cs)
            return
        if self.should_restart(cs):
            self.restart_with_backoff(cs)
        else:
            cs.waiting = None
            cs.retry_at = None

    def restart_with_backoff(self, cs: ContainerState) -> None:
        assert cs.instance is not None and cs.instance.exit is not None
        finished = parse_time(cs.instance.exit.finished_at)
        now = time.time()
        if cs.backoff.in_backoff_since(finished, now):
            dur = int(cs.backoff.duration or 0)
            msg = (f"back-off {_fmt_duration(dur)} restarting failed container={cs.name} "
                   f"pod={self.name}_{self.namespace}({self.uid})")
            if cs.waiting is None or cs.waiting[0] != "CrashLoopBackOff":
                self.node.events.pod_event(self.pod, "Warning", "BackOff", "Back-off restarting failed container "
                                           f"{cs.name} in pod {self.name}_{self.namespace}({self.uid})",
                                           self._field_path(cs))
            cs.waiting = ("CrashLoopBackOff", msg)
            cs.retry_at = cs.backoff.deadline(finished)
            return
        cs.backoff.next(finished)
        self.start_container(cs)

    def _field_path(self, cs: ContainerState) -> str:
        kind = "initContainers" if cs.init else "containers"
        return f"spec.{kind}{{{cs.name}}}"

    def pull(self, cs: ContainerState) -> catalog.Image | None:
        """The container's image, pulling it (from the catalog) if needed; None
        (with the waiting reason set) when it cannot be had now."""
        ref = cs.spec.get("image") or ""
        now = time.time()
        fp = self._field_path(cs)
        if cs.pull_failed_at is not None and cs.pull_backoff.in_backoff_since(cs.pull_failed_at, now):
            if cs.waiting is None or cs.waiting[0] != "ImagePullBackOff":
                self.node.events.pod_event(self.pod, "Normal", "BackOff", f'Back-off pulling image "{ref}"', fp)
            cs.waiting = ("ImagePullBackOff", f'Back-off pulling image "{ref}"')
            cs.retry_at = cs.pull_backoff.deadline(cs.pull_failed_at)
            return None
        tag = ref.rsplit("/", 1)[-1]
        default_policy = "Always" if (":" not in tag or tag.endswith(":latest")) and "@" not in ref else "IfNotPresent"
        policy = cs.spec.get("imagePullPolicy") or default_policy
        try:
            img = catalog.lookup(ref, self.node.tools_dir)
        except catalog.ImageNotFound as exc:
            if policy == "Never":
                msg = f'Container image "{ref}" is not present with pull policy of Never'
                cs.waiting = ("ErrImageNeverPull", msg)
                self.node.events.pod_event(self.pod, "Warning", "ErrImageNeverPull", msg, fp)
                cs.retry_at = now + SYNC_RETRY_S
                return None
            self.node.events.pod_event(self.pod, "Normal", "Pulling", f'Pulling image "{ref}"', fp)
            cs.pull_backoff.next(now)
            cs.pull_failed_at = now
            msg = f'Failed to pull image "{ref}": {exc}'
            self.node.events.pod_event(self.pod, "Warning", "Failed", msg, fp)
            self.node.events.pod_event(self.pod, "Warning", "Failed", "Error: ErrImagePull", fp)
            cs.waiting = ("ErrImagePull", msg)
            cs.retry_at = now + PULL_STATUS_RESYNC_S
            return None
        cs.pull_failed_at = None
        present = img.reference in self.node.images or img.pull_seconds <= 0
        if present and policy != "Always":
            self.node.events.pod_event(self.pod, "Normal", "Pulled",
                                       f'Container image "{ref}" already present on machine', fp)
            self.node.images.add(img.reference)
            return img
        self.node.events.pod_event(self.pod, "Normal", "Pulling", f'Pulling image "{ref}"', fp)
        cs.waiting = ("ContainerCreating", "")
        t0 = time.monotonic()
        if not present:
            self.publish()  # show ContainerCreating during a slow pull
            with self.node.pull_lock:
                if self._abort.wait(img.pull_seconds):  # sleep-ok: simulated image download; cut short by deletion
                    return None
        self.node.images.add(img.reference)
        took = time.monotonic() - t0
        self.node.events.pod_event(self.pod, "Normal", "Pulled",
                                   f'Successfully pulled image "{ref}" in {took:.3f}s', fp)
        return img

    def start_container(self, cs: ContainerState) -> None:
        """Pull, build the configuration, and start one new instance of ``cs``."""
        img = self.pull(cs)
        if img is None or self._abort.is_set():
            return
        cs.image = img
        fp = self._field_path(cs)
        try:
            env = self.environment(cs.spec)
        except (ContainerConfigError, ApiError) as exc:
            cs.waiting = ("CreateContainerConfigError", str(exc))
            self.node.events.pod_event(self.pod, "Warning", "Failed", f"Error: {exc}", fp)
            cs.retry_at = time.time() + SYNC_RETRY_S
            return
        full_env = {**img.env, **env, **img.forced_env}
        full_env.setdefault("HOSTNAME", pod_hostname(self.pod)[0])
        argv = command_line(cs.spec, env, list(img.entrypoint), list(img.cmd))
        assert self.volumes is not None
        try:
            mounts = [m.as_spec() for m in self.volumes.mounts_for(cs.spec, env)]
        except VolumeError as exc:
            cs.waiting = ("CreateContainerConfigError", str(exc))
            self.node.events.pod_event(self.pod, "Warning", "Failed", f"Error: {exc}", fp)
            cs.retry_at = time.time() + SYNC_RETRY_S
            return
        etc = self.dir / "etc"
        mounted = {m["target"] for m in mounts}
        for name in ("hosts", "hostname", "resolv.conf"):
            if f"/etc/{name}" not in mounted:
                mounts.append({"type": "bind", "source": str(etc / name), "target": f"/etc/{name}"})
        restart = 0 if cs.instance is None else cs.instance.restart + 1
        if cs.instance is not None and cs.instance.exit is not None:
            cs.last_terminated = terminated_dict(cs.instance)
            self._prune_instances(cs, restart)
        cs.stop_probes()
        host, _ = pod_hostname(self.pod)
        spec = LaunchSpec(
            argv=argv, env=full_env, workdir=cs.spec.get("workingDir") or img.workdir, hostname=host,
            netns=self.netns, mounts=mounts, memory_limit=memory_limit_bytes(cs.spec),
            termination_message_path=cs.spec.get("terminationMessagePath") or "/dev/termination-log",
            termination_message_policy=cs.spec.get("terminationMessagePolicy") or "File",
        )
        inst = self.node.runtime.new_instance(self.uid, cs.name, restart, self.dir, self._on_exit)
        inst.start(spec)
        if img.entry == "ray" and inst.cgroup is not None:
            # This machine's cores are shared by every node, so a starting Ray
            # node can lose its raylet's fixed 15 s race with its dashboard
            # agent (core/ray_agent.py); the agent gets precedence inside
            # the container's own session until it has written its port.
            threading.Thread(target=favour_dashboard_agent_while_starting,
                             args=(inst.cgroup.pids, inst.dir / "tmp" / "ray", lambda: inst.running),
                             name=f"agent-start-{self.name}-{cs.name}-{restart}", daemon=True).start()
        cs.instance = inst
        cs.waiting = None
        cs.retry_at = None
        cs.kill_reason = None
        self.node.events.pod_event(self.pod, "Normal", "Created", f"Created container: {cs.name}", fp)
        self.node.events.pod_event(self.pod, "Normal", "Started", f"Started container {cs.name}", fp)
        self._start_probes(cs, inst)
        hook = ((cs.spec.get("lifecycle") or {}).get("postStart"))
        if hook:
            ok, message = self.run_hook(cs, hook, float(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)))
            if not ok:
                self.node.events.pod_event(self.pod, "Warning", "FailedPostStartHook",
                                           f"PostStartHook failed: {message}", fp)
                inst.stop(self._grace(), "FailedPostStartHook")

    def _prune_instances(self, cs: ContainerState, restart: int) -> None:
        """Keep the current and the previous instance only (upstream keeps one dead container)."""
        old = restart - 2
        if old >= 0:
            shutil.rmtree(self.dir / "containers" / cs.name / str(old), ignore_errors=True)
            (self.dir / "logs" / cs.name / f"{old}.log").unlink(missing_ok=True)
        # The previous instance's scratch (its /tmp) is not needed once it is dead.
        prev = self.dir / "containers" / cs.name / str(restart - 1)
        for sub in ("tmp", "scratch"):
            shutil.rmtree(prev / sub, ignore_errors=True)

    def environment(self, container: Mapping[str, Any]) -> dict[str, str]:
        ns = self.namespace
        svc_env: dict[str, str] = {}
        try:
            master = self.node.api.get("/api/v1/namespaces/default/services/kubernetes")
            svc_env.update(service_env([master]))
        except ApiError:
            pass
        if self.spec.get("enableServiceLinks", True):
            listed = self.node.api.get(f"/api/v1/namespaces/{ns}/services")
            svc_env.update(service_env([s for s in listed.get("items") or []
                                        if not (ns == "default" and s["metadata"]["name"] == "kubernetes")]))

        def getter(kind: str) -> Callable[[str, str], Any]:
            def get(namespace: str, name: str) -> Any:
                try:
                    return self.node.api.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
                except ApiError as exc:
                    if exc.not_found:
                        return None
                    raise
            return get

        return container_env(self.pod, container, pod_ip=self.pod_ip, host_ip=self.node.host_ip,
                             allocatable=self.node.allocatable, get_configmap=getter("configmaps"),
                             get_secret=getter("secrets"), services_env=svc_env)

    def _start_probes(self, cs: ContainerState, inst: ContainerInstance) -> None:
        def changed(worker: ProbeWorker) -> None:
            if worker.kind in ("liveness", "startup") and worker.result is False:
                cs.kill_reason = worker.kind
            if worker.result is not True and worker.last_message:
                self.node.events.pod_event(self.pod, "Warning", "Unhealthy",
                                           f"{worker.kind.capitalize()} probe failed: {worker.last_message}",
                                           self._field_path(cs))
            self._wake.set()

        startup = cs.spec.get("startupProbe")
        gate: Callable[[], bool] | None = None
        if startup:
            sp = ProbeWorker("startup", startup, cs.spec, inst, self.netns, self.pod_ip, changed)
            cs.probes["startup"] = sp
            gate = lambda: sp.result is True  # noqa: E731 - liveness/readiness wait for startup
        for kind, key in (("liveness", "livenessProbe"), ("readiness", "readinessProbe")):
            if cs.spec.get(key) and not (cs.init and not cs.sidecar):
                cs.probes[kind] = ProbeWorker(kind, cs.spec[key], cs.spec, inst, self.netns, self.pod_ip,
                                              changed, gate)
        if startup:
            orig = changed

            def changed_and_poke(worker: ProbeWorker) -> None:
                orig(worker)
                if worker.kind == "startup" and worker.result is True:
                    for other in list(cs.probes.values()):
                        if other is not worker:
                            other.poke()
            for p in cs.probes.values():
                p.on_change = changed_and_poke
        for p in cs.probes.values():
            p.start()

    def _on_exit(self, inst: ContainerInstance) -> None:
        self._wake.set()

    def kill_for_probe(self, cs: ContainerState) -> None:
        assert cs.instance is not None
        kind = cs.kill_reason
        fp = self._field_path(cs)
        self.node.events.pod_event(self.pod, "Normal", "Killing",
                                   f"Container {cs.name} failed {kind} probe, will be restarted", fp)
        probe = cs.spec.get(f"{kind}Probe") or {}
        grace = probe.get("terminationGracePeriodSeconds")
        cs.stop_probes()
        self.stop_container(cs, float(grace) if grace is not None else self._grace(), run_pre_stop=True,
                            announce=False)
        cs.kill_reason = None

    # -- hooks ----------------------------------------------------------------------

    def run_hook(self, cs: ContainerState, hook: Mapping[str, Any], timeout: float) -> tuple[bool, str]:
        inst = cs.instance
        if inst is None or not inst.running:
            return True, ""
        if hook.get("exec"):
            rc, out = inst.exec(list(hook["exec"].get("command") or []), timeout)
            return rc == 0, out.strip()[:1024] if rc != 0 else ""
        if hook.get("sleep"):
            self._abort.wait(min(float(hook["sleep"].get("seconds", 0)), timeout))  # sleep-ok: the hook's own sleep action
            return True, ""
        if hook.get("httpGet"):
            probe = {"httpGet": hook["httpGet"], "timeoutSeconds": timeout}
            out = run_probe(probe, cs.spec, inst, self.netns, self.pod_ip)
            return out.success, out.message
        return True, ""

    def _grace(self) -> float:
        meta_grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if meta_grace is not None and self.pod["metadata"].get("deletionTimestamp"):
            return float(meta_grace)
        return float(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))

    def stop_container(self, cs: ContainerState, grace: float, run_pre_stop: bool, announce: bool = True) -> None:
        inst = cs.instance
        if inst is None or not inst.running:
            return
        deadline = time.monotonic() + grace
        hook = (cs.spec.get("lifecycle") or {}).get("preStop")
        if run_pre_stop and hook and not self._stopping_agent:
            ok, message = self.run_hook(cs, hook, grace)
            if not ok:
                self.node.events.pod_event(self.pod, "Warning", "FailedPreStopHook",
                                           f"PreStopHook failed: {message}", self._field_path(cs))
        if announce:
            self.node.events.pod_event(self.pod, "Normal", "Killing", f"Stopping container {cs.name}",
                                       self._field_path(cs))
        inst.stop(max(0.0, deadline - time.monotonic()))

    # -- terminal states ------------------------------------------------------------

    def _deadline_exceeded(self) -> bool:
        ads = self.spec.get("activeDeadlineSeconds")
        if not ads or not self.start_time or time.time() < parse_time(self.start_time) + float(ads):
            return False
        self.pod_reason = ("DeadlineExceeded", "Pod was active on the node longer than the specified deadline")
        self.node.events.pod_event(self.pod, "Normal", "DeadlineExceeded", self.pod_reason[1])
        self.kill_all(self._grace(), run_pre_stop=True)
        self.become_terminal("Failed")
        return True

    def become_terminal(self, phase: str) -> None:
        """The pod will run nothing more (an init container failed under
        ``restartPolicy: Never``, or the active deadline passed)."""
        self.terminal_phase = phase
        self.finish_terminal()
        self.publish()

    def finish_terminal(self) -> None:
        """Once terminal: stop what still runs (sidecars) and tear down the
        sandbox's network, as the kubelet does; volumes stay until deletion."""
        if self._terminal_done:
            return
        self._terminal_done = True
        self.kill_all(self._grace(), run_pre_stop=True)
        self.release_network()

    def kill_all(self, grace: float, run_pre_stop: bool) -> None:
        """Stop every running container in parallel within one grace period,
        containers first, then sidecars (as upstream orders termination)."""
        for group in (self.app_states, [c for c in self.init_states if c.running]):
            threads = []
            for cs in group:
                cs.stop_probes()
                if cs.running:
                    t = threading.Thread(target=self.stop_container, args=(cs, grace, run_pre_stop), daemon=True)
                    t.start()
                    threads.append(t)
            for t in threads:
                t.join()  # each stop is bounded by the grace period plus PROCESS_EXIT
            for cs in group:
                cs.retry_at = None
                if cs.instance is not None and not cs.running:
                    cs.waiting = None

    def release_network(self) -> None:
        if self.attachment and self.node.podnet is not None:
            with contextlib.suppress(Exception):
                self.node.podnet.detach(self.pod_key)

    def terminate(self, graceful: bool) -> None:
        """Stop everything; for a graceful deletion, write the final status and delete the pod object."""
        self.terminating = True
        grace = 0.0 if self._stopping_agent else self._grace()
        self.kill_all(grace, run_pre_stop=graceful)
        if graceful and not self._stopping_agent and self.sandbox_ready:
            # Only a pod this worker ran has a status of ours to write.
            with contextlib.suppress(ApiError, OSError):
                self.publish()
        if self.volumes is not None:
            self.volumes.teardown()
        st.cleanup_pod(self.node.state_dir, self.record,
                       (lambda rec: self.release_network()) if self.attachment else None)
        if graceful and not self._stopping_agent:
            meta = self.pod["metadata"]
            try:
                self.node.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                     {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                      "preconditions": {"uid": self.uid}})
            except ApiError as exc:
                if not (exc.not_found or exc.conflict):
                    raise

    # -- status ---------------------------------------------------------------------

    def container_status(self, cs: ContainerState) -> dict[str, Any]:
        inst = cs.instance
        s: dict[str, Any] = {"name": cs.name, "image": cs.spec.get("image", ""),
                             "imageID": cs.image.image_id if (cs.image and inst) else "",
                             "ready": False, "started": False,
                             "restartCount": inst.restart if inst else 0}
        if inst is not None:
            s["containerID"] = f"rayproof://{inst.container_id}"
        last: dict[str, Any] = {}
        if inst is None:
            reason, message = cs.waiting or (("PodInitializing" if (not cs.init and not self.initialized
                                                                    and self.sandbox_ready) else "ContainerCreating"), "")
            if cs.init and self.sandbox_ready and cs.waiting is None:
                reason = "PodInitializing"
            state: dict[str, Any] = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        elif inst.running:
            state = {"running": {"startedAt": inst.started_at}}
            s["started"] = cs.started
            s["ready"] = cs.ready
            if cs.last_terminated:
                last = {"terminated": cs.last_terminated}
        else:
            term = terminated_dict(inst)
            if cs.waiting is not None:
                reason, message = cs.waiting
                state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
                last = {"terminated": term}
            else:
                state = {"terminated": term}
                if cs.last_terminated:
                    last = {"terminated": cs.last_terminated}
                if cs.init and not cs.sidecar and term["exitCode"] == 0:
                    s["ready"] = True
        s["state"] = state
        s["lastState"] = last
        return s

    def compute_status(self) -> dict[str, Any]:
        with self.lock:
            pod = self.pod
        current = pod.get("status") or {}
        init_statuses = [self.container_status(cs) for cs in self.init_states]
        statuses = [self.container_status(cs) for cs in self.app_states]
        phase = self.terminal_phase or pod_status.pod_phase(
            self.spec, init_statuses, statuses, terminal=self.terminating, initialized_once=self.initialized)
        if phase in ("Succeeded", "Failed") and not self.terminal_phase and not self.terminating:
            self.terminal_phase = phase
        now = now_rfc3339()
        initialized = pod_status.initialized_condition(self.spec, init_statuses, phase)
        containers_ready = pod_status.containers_ready_condition(self.spec, init_statuses, statuses, phase)
        ready = pod_status.ready_condition(containers_ready, self.spec, current.get("conditions") or [])
        sandbox = {"type": "PodReadyToStartContainers",
                   "status": "True" if (self.sandbox_ready and not self.terminal_phase and not self.terminating)
                   else "False"}
        conditions = pod_status.merge_conditions(current.get("conditions") or [],
                                                 [sandbox, initialized, ready, containers_ready], now)
        out: dict[str, Any] = {"phase": phase, "conditions": conditions,
                               "hostIP": self.node.host_ip, "hostIPs": [{"ip": self.node.host_ip}],
                               "startTime": self.start_time}
        if self.pod_ip:
            out["podIP"] = self.pod_ip
            out["podIPs"] = [{"ip": self.pod_ip}]
        if self.init_states:
            out["initContainerStatuses"] = init_statuses
        out["containerStatuses"] = statuses
        for keep in ("qosClass", "nominatedNodeName", "resourceClaimStatuses", "resize"):
            if current.get(keep) is not None:
                out[keep] = current[keep]
        if self.pod_reason:
            out["reason"], out["message"] = self.pod_reason
        return out

    def publish(self) -> None:
        """PUT the status if it changed since the last write (conflicts: re-read and retry)."""
        new = self.compute_status()
        comparable = _without_times(new)
        if self.last_published is not None and comparable == self.last_published:
            return
        for attempt in range(3):
            with self.lock:
                body = copy.deepcopy(self.pod)
            body["status"] = new
            meta = body["metadata"]
            try:
                updated = self.node.api.put(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", body)
                with self.lock:
                    if updated and updated.get("metadata", {}).get("uid") == self.uid:
                        self.pod = updated
                self.last_published = comparable
                return
            except ApiError as exc:
                if exc.not_found:
                    self.remove()
                    return
                if not exc.conflict or attempt == 2:
                    raise
                fresh = self.node.api.get(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
                if fresh["metadata"]["uid"] != self.uid:
                    self.remove()
                    return
                with self.lock:
                    self.pod = fresh
                new = self.compute_status()
                comparable = _without_times(new)

    # -- for the logs server ------------------------------------------------------------

    def log_path(self, container: str, previous: bool) -> tuple[Path | None, ContainerInstance | None, str]:
        """(log file, instance, error) for ``kubectl logs [--previous]``."""
        cs = self.state_of(container)
        if cs is None:
            return None, None, f"container {container} is not valid for pod {self.name}"
        inst = cs.instance
        if inst is None:
            reason = (cs.waiting or ("ContainerCreating", ""))[0]
            return None, None, f'container "{container}" in pod "{self.name}" is waiting to start: {reason}'
        if previous:
            # The container before the most recent one (which may itself be dead,
            # e.g. in CrashLoopBackOff: then plain `logs` shows its output).
            path = self.dir / "logs" / container / f"{inst.restart - 1}.log"
            if inst.restart == 0 or not path.exists():
                return None, None, f'previous terminated container "{container}" in pod "{self.name}" not found'
            return path, None, ""
        return inst.log_path, inst, ""


def _without_times(status: Mapping[str, Any]) -> dict[str, Any]:
    """The status without condition timestamps, to decide whether anything changed."""
    out = copy.deepcopy(dict(status))
    for c in out.get("conditions") or []:
        c.pop("lastTransitionTime", None)
        c.pop("lastProbeTime", None)
    return out


def _fmt_duration(seconds: int) -> str:
    """Go's time.Duration.String for whole seconds (``10s``, ``1m20s``, ``5m0s``)."""
    if seconds < 60:
        return f"{seconds}s"
    m, s = divmod(seconds, 60)
    if m < 60:
        return f"{m}m{s}s"
    h, m = divmod(m, 60)
    return f"{h}h{m}m{s}s"


def _parse_resolv(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"nameservers": [], "searches": [], "options": []}
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith(("#", ";")):
            continue
        if parts[0] == "nameserver" and len(parts) > 1:
            out["nameservers"].append(parts[1])
        elif parts[0] in ("search", "domain"):
            out["searches"] += parts[1:]
        elif parts[0] == "options":
            out["options"] += parts[1:]
    return out
