"""Node registration and heartbeats: the Node object, its status and its Lease.

What the kubelet does at start and then forever (``kubelet_node_status.go``,
``nodelease``):

* creates its Node with labels (``kubernetes.io/hostname``/``os``/``arch``
  and the profile's), taints (the profile's plus
  ``node.kubernetes.io/not-ready:NoSchedule``, which the node lifecycle
  controller removes once it has seen the node Ready), and a full status:
  capacity = allocatable from the profile (``cpu``, ``memory``, ``pods``,
  ``nvidia.com/gpu``), conditions, addresses (``InternalIP`` 127.0.0.1 and
  ``Hostname``), ``daemonEndpoints.kubeletEndpoint.Port`` (this node's
  read-only API, see ``logs_server.py``) and ``nodeInfo``;
* renews ``kube-node-lease/<node>`` every 10 s (lease duration 40 s): the
  node lifecycle controller's liveness signal;
* re-posts the node status when it changes and at least every 5 minutes
  (``nodeStatusReportFrequency``), with ``Ready`` heartbeats.

Each node speaks as ``system:node:<name>`` when node certificates are given,
so the Node authorizer and NodeRestriction apply; labels NodeRestriction
forbids a node to set on itself (e.g. ``node-role.kubernetes.io/*``) are
applied afterwards with the admin client, as an administrator would.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import platform
import threading
import time
from typing import Any, Mapping

from clusters.embedded.nodeagent.kube import ApiError, KubeClient

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 10.0  # nodeLeaseRenewIntervalFraction 0.25 x 40 s
STATUS_UPDATE_S = 10.0  # nodeStatusUpdateFrequency
STATUS_REPORT_S = 300.0  # nodeStatusReportFrequency: re-post unchanged status this often
DEFAULT_MAX_PODS = "110"
NOT_READY_TAINT = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
RUNTIME_VERSION = "rayproof://0.1.0"
# Label prefixes NodeRestriction lets a kubelet set on its own Node.
_KUBELET_LABELS = {
    "kubernetes.io/hostname", "kubernetes.io/arch", "kubernetes.io/os", "beta.kubernetes.io/arch",
    "beta.kubernetes.io/os", "beta.kubernetes.io/instance-type", "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region", "failure-domain.beta.kubernetes.io/zone",
    "topology.kubernetes.io/region", "topology.kubernetes.io/zone",
}
_KUBELET_LABEL_PREFIXES = ("kubelet.kubernetes.io/", "node.kubernetes.io/")


def kubelet_may_set(label: str) -> bool:
    """Whether NodeRestriction allows a node to set ``label`` on itself."""
    prefix = label.split("/", 1)[0] if "/" in label else ""
    if label in _KUBELET_LABELS or label.startswith(_KUBELET_LABEL_PREFIXES):
        return True
    if prefix.startswith("node-restriction.kubernetes.io"):
        return False
    return not (prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io")
                or prefix == "k8s.io" or prefix.endswith(".k8s.io"))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _boot_id() -> str:
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return ""


class NodeRegistration:
    """One node's object, status heartbeats and lease."""

    def __init__(self, api: KubeClient, name: str, *, host_ip: str, port: int, capacity: Mapping[str, str],
                 labels: Mapping[str, str], taints: list[dict[str, Any]], kubelet_version: str,
                 admin: KubeClient | None = None):
        self.api = api
        self.admin = admin
        self.name = name
        self.host_ip = host_ip
        self.port = port
        self.capacity = {"pods": DEFAULT_MAX_PODS, **dict(capacity)}
        self.labels = dict(labels)
        self.taints = list(taints)
        self.kubelet_version = kubelet_version
        self.uid: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{name}", daemon=True)
        self._last_report = 0.0
        self._last_status: dict[str, Any] | None = None
        self._transitions: dict[str, str] = {}
        self.errors = 0

    # -- the Node object ----------------------------------------------------------

    def base_labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "rayproof-embedded"}

    def conditions(self) -> list[dict[str, Any]]:
        now = _now()
        rows = [("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                ("Ready", "True", "KubeletReady", "kubelet is posting ready status")]
        out = []
        for kind, status, reason, message in rows:
            out.append({"type": kind, "status": status, "reason": reason, "message": message,
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": self._transitions.setdefault(f"{kind}={status}", now)})
        return out

    def status(self) -> dict[str, Any]:
        machine = hashlib.sha256(self.name.encode()).hexdigest()[:32]
        return {
            "capacity": dict(self.capacity),
            "allocatable": dict(self.capacity),
            "conditions": self.conditions(),
            "addresses": [{"type": "InternalIP", "address": self.host_ip}, {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            "nodeInfo": {
                "machineID": machine, "systemUUID": machine, "bootID": _boot_id(),
                "kernelVersion": platform.release(), "osImage": "rayproof embedded node (host: Linux)",
                "containerRuntimeVersion": RUNTIME_VERSION, "kubeletVersion": self.kubelet_version,
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        }

    def register(self) -> dict[str, Any]:
        """Create the Node (or take over an existing one of the same name)."""
        own = {k: v for k, v in {**self.base_labels(), **self.labels}.items() if kubelet_may_set(k)}
        foreign = {k: v for k, v in self.labels.items() if not kubelet_may_set(k)}
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": own,
                             "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                             "rayproof.dev/node-agent": "clusters.embedded.nodeagent"}},
                "spec": {"taints": [*self.taints, NOT_READY_TAINT]},
                "status": self.status()}
        try:
            node = self.api.post("/api/v1/nodes", body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            node = self.api.get(f"/api/v1/nodes/{self.name}")
            self.api.patch(f"/api/v1/nodes/{self.name}", {"metadata": {"labels": own}})
            node = self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": self.status()})
        self.uid = node["metadata"]["uid"]
        if foreign:
            if self.admin is None:
                raise ValueError(f"labels {sorted(foreign)} can only be set by an administrator: pass the admin client")
            self.admin.patch(f"/api/v1/nodes/{self.name}", {"metadata": {"labels": foreign}})
        self._last_report = time.monotonic()
        self.renew_lease()
        return node

    # -- heartbeats ----------------------------------------------------------------

    def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}"
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": _micro_now()}
        try:
            lease = self.api.get(path)
            lease["spec"].update(spec)
            self.api.put(path, lease)
        except ApiError as exc:
            if not exc.not_found:
                raise
            owner = [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}] if self.uid else []
            self.api.post(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                          {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": self.name, "namespace": LEASE_NAMESPACE, "ownerReferences": owner},
                           "spec": spec})

    def post_status(self, force: bool = False) -> None:
        status = self.status()
        comparable = {k: v for k, v in status.items() if k != "conditions"}
        comparable["conditions"] = [(c["type"], c["status"]) for c in status["conditions"]]
        due = time.monotonic() - self._last_report >= STATUS_REPORT_S
        if not force and not due and comparable == self._last_status:
            return
        self.api.patch(f"/api/v1/nodes/{self.name}/status", {"status": status})
        self._last_status = comparable
        self._last_report = time.monotonic()

    def start(self) -> "NodeRegistration":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        next_status = time.monotonic() + STATUS_UPDATE_S
        while not self._stop.wait(LEASE_RENEW_S):  # sleep-ok: lease renewal period, ended by stop()
            try:
                self.renew_lease()
                if time.monotonic() >= next_status:
                    self.post_status()
                    next_status = time.monotonic() + STATUS_UPDATE_S
            except (ApiError, OSError, Exception):  # noqa: BLE001 - a missed beat is retried at the next period
                self.errors += 1
