"""The node agent: N nodes of the embedded platform in one process.

:class:`NodeAgent` is what the platform starts (in-process, or as ``python -m
clusters.embedded.nodeagent`` under its supervisor). For each node it runs
what a kubelet runs: registration and heartbeats (``registration.py``), a
watch of the pods bound to it, one worker per pod (``pods.py``), an event
recorder and the read-only kubelet API (``logs_server.py``). The nodes share
one container runtime (``containers.py``: cgroups under one parent), one pod
network (``clusters.embedded.podnet``) and one state directory
(``state.py``), so ``stop()`` -- or ``down`` from another process after a
crash -- finds and removes everything.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from clusters.embedded.nodeagent import catalog
from clusters.embedded.nodeagent import state as st
from clusters.embedded.nodeagent.containers import Runtime
from clusters.embedded.nodeagent.events import EventRecorder
from clusters.embedded.nodeagent.kube import ApiError, KubeClient, load_kubeconfig
from clusters.embedded.nodeagent.logs_server import KubeletServer
from clusters.embedded.nodeagent.pods import NodeContext, PodNetworkLike, PodWorker
from clusters.embedded.nodeagent.provisioner import DirectoryProvisioner
from clusters.embedded.nodeagent.registration import NodeRegistration
from clusters.embedded.profile import Profile, load_profile
from core import timeouts
from core.waiting import WaitTimeout, wait_for

log = logging.getLogger(__name__)

NAME_PREFIX = "rayproof-node"
HOST_IP = "127.0.0.1"
WATCH_RETRY_S = 1.0


class AgentError(RuntimeError):
    """The node agent cannot start (the message says what to do)."""


class Node:
    """One node: its registration, pod watch, pod workers and kubelet API."""

    def __init__(self, agent: "NodeAgent", index: int, name: str, api: KubeClient,
                 serving: tuple[str, str] | None, ca_file: str | None):
        self.agent = agent
        self.index = index
        self.name = name
        self.api = api
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.events = EventRecorder(api, name)
        self.server: KubeletServer | None = None
        if serving is not None:
            self.server = KubeletServer(name, 0, serving[0], serving[1], ca_file, self.find_worker, self.list_pods,
                                        host=agent.host_ip)
        self.ctx = NodeContext(
            name=name, host_ip=agent.host_ip, api=api, events=self.events, runtime=agent.runtime,
            podnet=agent.podnet, state_dir=agent.state_dir, allocatable=agent.allocatable,
            tools_dir=str(agent.tools_dir), forget=self._forget,
        )
        self.registration = NodeRegistration(
            api, name, host_ip=agent.host_ip, port=self.server.port if self.server else 0,
            capacity=agent.allocatable, labels={**agent.labels, "rayproof.dev/node-index": str(index)},
            taints=list(agent.taints), kubelet_version=agent.kubelet_version, admin=agent.admin,
        )
        self._watch_thread = threading.Thread(target=self._watch_loop, name=f"pod-watch-{name}", daemon=True)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self.events.start()
        if self.server is not None:
            self.server.start()
        self.registration.register()
        self.registration.start()
        self._watch_thread.start()

    def stop_pods(self) -> list[PodWorker]:
        """Tell every pod worker to kill its pod now; return them (to wait on)."""
        self._stop.set()
        self.api.stop()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop_for_agent()
        return workers

    def stop_services(self) -> None:
        self.registration.stop()
        self.events.stop()
        if self.server is not None:
            self.server.stop()
        self.api.close()

    # -- pods -------------------------------------------------------------------------

    def find_worker(self, namespace: str, name: str) -> PodWorker | None:
        with self.lock:
            for w in self.workers.values():
                if w.namespace == namespace and w.name == name and not w.finished.is_set():
                    return w
        return None

    def list_pods(self) -> list[dict[str, Any]]:
        with self.lock:
            return [w.pod for w in self.workers.values()]

    def _forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)

    def _dispatch(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.remove()
                return
            if worker is None:
                if self._stop.is_set():
                    return
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") and not pod["metadata"].get(
                        "deletionTimestamp"):
                    # A finished pod from before this agent started: nothing to run, as upstream.
                    return
                worker = PodWorker(self.ctx, pod)
                self.workers[uid] = worker
                worker.start()
                return
        worker.update(pod)

    def _watch_loop(self) -> None:
        selector = f"spec.nodeName={self.name}"
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listing = self.api.get("/api/v1/pods", fieldSelector=selector)
                    rv = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listing.get("items") or []:
                        seen.add(pod["metadata"]["uid"])
                        self._dispatch("MODIFIED", pod)
                    with self.lock:
                        gone = [w for uid, w in self.workers.items() if uid not in seen]
                    for w in gone:
                        w.remove()
                for event in self.api.watch("/api/v1/pods", rv, fieldSelector=selector):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            rv = None  # too old: relist
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._dispatch(kind, obj)
            except ApiError as exc:
                if exc.gone:
                    rv = None
                self._stop.wait(WATCH_RETRY_S)  # sleep-ok: watch retry pacing, ended by stop()
            except (OSError, ValueError, KeyError):
                self._stop.wait(WATCH_RETRY_S)  # sleep-ok: watch retry pacing, ended by stop()


class NodeAgent:
    """Registers and runs ``nodes`` nodes against the API server of ``kubeconfig``.

    ``podnet`` is a :class:`clusters.embedded.podnet.PodNetwork` (opened by the
    caller). ``pki`` is the control plane's :class:`~clusters.embedded.pki.ClusterPKI`
    or its directory; with it each node authenticates as ``system:node:<name>``
    and serves its kubelet API with a CA-signed certificate (default: the
    ``pki/`` directory beside the kubeconfig, the platform's layout).
    """

    def __init__(self, kubeconfig: str | Path, profile: Profile | Mapping[str, Any] | str | Path | None = None,
                 state_dir: str | Path = "nodeagent", podnet: PodNetworkLike | None = None, *,
                 nodes: int | None = None, pki: Any = None, name_prefix: str = NAME_PREFIX,
                 host_ip: str = HOST_IP, labels: Mapping[str, str] | None = None,
                 taints: Sequence[Mapping[str, Any]] = ()):
        self.kubeconfig = Path(kubeconfig)
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self.state_dir = Path(state_dir).resolve()
        self.podnet = podnet
        self.count = int(nodes if nodes is not None else self.profile.node_count)
        self.name_prefix = name_prefix
        self.host_ip = host_ip
        # The profile may name node labels and taints (``nodes.labels``,
        # ``nodes.taints``); arguments add to them.
        nodes_cfg = self.profile.data.get("nodes") or {}
        self.labels = {**dict(nodes_cfg.get("labels") or {}), **dict(labels or {})}
        self.taints = [dict(t) for t in (nodes_cfg.get("taints") or [])] + [dict(t) for t in taints]
        self._pki_arg = pki
        shape = self.profile.node_shape
        self.allocatable: dict[str, str] = {"pods": "110", **shape}
        if "nvidia.com/gpu" in shape:
            self.labels.setdefault("nvidia.com/gpu.present", "true")
        self.runtime = Runtime(self.state_dir)
        self.tools_dir = self.state_dir / "image-tools"
        self.nodes: list[Node] = []
        self.admin: KubeClient | None = None
        self.provisioner: DirectoryProvisioner | None = None
        self.kubelet_version = "v0.0.0"
        self._started = False
        self._stopped = False

    @property
    def node_names(self) -> list[str]:
        return [f"{self.name_prefix}-{i}" for i in range(1, self.count + 1)]

    def _pki(self) -> Any:
        from clusters.embedded import pki as pki_mod

        arg = self._pki_arg
        if arg is None:
            guess = self.kubeconfig.resolve().parent / "pki"
            if (guess / "ca.key").is_file():
                arg = guess
        if arg is None:
            return None
        if isinstance(arg, (str, Path)):
            return pki_mod.ensure_pki(Path(arg))
        return arg

    # -- start / stop -------------------------------------------------------------------

    def start(self) -> "NodeAgent":
        """Clean up what a crashed predecessor left, register the nodes, start
        serving them, and wait until the control plane sees them Ready and
        schedulable (``NODE_READY``)."""
        if self._started:
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        owner = st.read_json(self.state_dir / "agent.json")
        if owner and owner.get("pid") != os.getpid() and st.alive(owner.get("pid", 0), owner.get("start_ticks")):
            raise AgentError(f"another node agent (PID {owner['pid']}) uses {self.state_dir}; stop it first")
        leftovers = st.cleanup(self.state_dir, self._detach_record)
        if leftovers:
            log.warning("node agent: removed leftovers of a previous run: %s", leftovers)
        st.write_json(self.state_dir / "agent.json", {"pid": os.getpid(), "start_ticks": st.proc_start_ticks(os.getpid()),
                                                      "started_at": time.time(), "nodes": self.node_names})
        self.runtime.check()
        catalog.tools_dir_for(self.state_dir)
        creds = load_kubeconfig(self.kubeconfig, self.state_dir / "creds")
        self.admin = KubeClient(creds)
        self.kubelet_version = self.admin.get("/version").get("gitVersion", "v0.0.0")
        pki = self._pki()
        self._started = True
        self.provisioner = DirectoryProvisioner(KubeClient(creds, user_agent="rayproof-provisioner"), self.state_dir / "pvc")
        self.provisioner.start()
        try:
            for i, name in enumerate(self.node_names, start=1):
                serving = None
                api = KubeClient(creds, user_agent=f"rayproof-nodeagent/{name}")
                ca = creds.ca_file
                if pki is not None:
                    certs = pki.issue_node(name, [self.host_ip])
                    api = api.with_identity(str(certs.client.cert), str(certs.client.key),
                                            f"rayproof-nodeagent/{name}")
                    serving = (str(certs.serving.cert), str(certs.serving.key))
                    ca = str(pki.ca_file)
                node = Node(self, i, name, api, serving, ca)
                self.nodes.append(node)
                node.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Until every node is Ready and its not-ready taint is gone (pods can be scheduled)."""
        assert self.admin is not None
        names = set(self.node_names)

        def unready() -> dict[str, str]:
            out = {}
            for node in self.admin.get("/api/v1/nodes").get("items") or []:
                name = node["metadata"]["name"]
                if name not in names:
                    continue
                ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})
                taints = [t["key"] for t in (node.get("spec") or {}).get("taints") or []
                          if t["key"].startswith("node.kubernetes.io/")]
                if ready.get("status") != "True" or taints:
                    out[name] = f"Ready={ready.get('status')} taints={taints}"
            for name in names:
                if name not in [n["metadata"]["name"] for n in self.admin.get("/api/v1/nodes").get("items") or []]:
                    out[name] = "not registered"
            return out

        wait_for(unready, lambda bad: not bad, timeout=timeouts.NODE_READY, interval=0.5,
                 description=f"nodes {sorted(names)} to be Ready without node.kubernetes.io taints")

    def stop(self, delete_nodes: bool = False) -> list[str]:
        """Kill every container, remove every cgroup, namespace and pod directory
        this agent made, stop serving. Safe to repeat. Node objects stay (they
        turn NotReady, as when a kubelet dies) unless ``delete_nodes``."""
        done: list[str] = []
        if self.provisioner is not None:
            self.provisioner.stop()
        workers: list[PodWorker] = []
        for node in self.nodes:
            workers += node.stop_pods()
        for w in workers:
            with contextlib.suppress(WaitTimeout):
                wait_for(lambda w=w: w.finished.is_set(), timeout=timeouts.PROCESS_EXIT, interval=0.1,
                         description=f"pod worker of {w.namespace}/{w.name} to stop its containers")
        for node in self.nodes:
            node.stop_services()
        done += st.cleanup(self.state_dir, self._detach_record)
        if self.admin is not None:
            self.admin.close()
        if delete_nodes and self.kubeconfig.is_file():
            admin = KubeClient(load_kubeconfig(self.kubeconfig, self.state_dir / "creds"))
            for name in self.node_names:
                with contextlib.suppress(ApiError, OSError):
                    admin.delete(f"/api/v1/nodes/{name}")
                    done.append(f"node {name}")
            admin.close()
        # The credentials copied out of the kubeconfig (an admin key) and the
        # image tool links go too; pvc/ stays: it is the claims' data.
        for sub in ("creds", "image-tools"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        (self.state_dir / "agent.json").unlink(missing_ok=True)
        self.nodes = []
        self._stopped = True
        return done

    def _detach_record(self, rec: st.PodRecord) -> None:
        if self.podnet is not None:
            self.podnet.detach(rec.pod_key)
        elif rec.netns:
            subprocess.run(["ip", "netns", "delete", rec.netns], capture_output=True)

    def __enter__(self) -> "NodeAgent":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation ---------------------------------------------------------------------

    def workers(self) -> list[PodWorker]:
        out = []
        for node in self.nodes:
            with node.lock:
                out += list(node.workers.values())
        return out

    def ports(self) -> dict[str, int]:
        """Each node's kubelet API port."""
        return {n.name: n.server.port for n in self.nodes if n.server is not None}
