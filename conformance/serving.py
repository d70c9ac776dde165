"""A RayService as the clauses deploy it, and the load they put on it.

Shared by the Kubernetes clauses that keep a RayService serving through a
fault (GCS-1) or an operator upgrade (UPG-1): its Serve config, its status,
a load-generator pod POSTing at a steady rate with one ``RAYPROOF_EVENT``
line per second of load, and the availability of a window of it.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from core import timeouts
from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for
from fixtures.events import parse_events
from fixtures.kube import condition

REPO = Path(__file__).resolve().parents[1]
SERVE_CONFIG = REPO / "workloads" / "serve_config.yaml"
LOAD_GEN = REPO / "workloads" / "load_gen.py"
LOADGEN_CONFIGMAP = "rayproof-loadgen"
LOADGEN_MOUNT = "/opt/rayproof-loadgen"
SERVE_PORT = 8000
LOAD_RATE = 10.0  # requests per second during the whole event
REQUEST_TIMEOUT_S = 2.0
SERVICE_UP = Tier("rayservice_up", timeouts.RAYCLUSTER_READY.seconds + timeouts.SERVE_APP.seconds,
                  "a RayService's cluster up and its Serve applications RUNNING")


# -- Serve and its load ------------------------------------------------------------------


def serve_config(replicas: int) -> str:
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    for app in config["applications"]:
        for deployment in app.get("deployments", []):
            deployment["num_replicas"] = replicas
    return yaml.safe_dump(config, sort_keys=False)


def service_sample(lab, ns: str, name: str) -> dict[str, Any]:
    obj = lab.ray(ns, "rayservices", name)
    st = obj.get("status") or {}
    active = st.get("activeServiceStatus") or {}
    pending = st.get("pendingServiceStatus") or {}
    return {"cluster": active.get("rayClusterName"), "pending_cluster": pending.get("rayClusterName"),
            "apps": {k: (v or {}).get("status") for k, v in (active.get("applicationStatuses") or {}).items()},
            "service_ready": (condition(obj, "Ready") or {}).get("status"),
            "last_update": st.get("lastUpdateTime")}


def apps_running(sample: dict[str, Any]) -> bool:
    return bool(sample["apps"]) and all(s == "RUNNING" for s in sample["apps"].values())


def serve_endpoints(lab, ns: str, service: str) -> int:
    ep = lab.core.read_namespaced_endpoints(service, ns)
    return sum(len(s.addresses or []) for s in ep.subsets or [])


def start_load(lab, ns: str, url: str, duration_s: float) -> str:
    """A load-generator pod POSTing to ``url`` at LOAD_RATE for ``duration_s``;
    its log has one RAYPROOF_EVENT line per second of load."""
    lab.core.create_namespaced_config_map(ns, {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": LOADGEN_CONFIGMAP, "labels": dict(lab.labels)},
        "data": {"load_gen.py": LOAD_GEN.read_text()}})
    name = lab.name("load")
    argv = ["python", f"{LOADGEN_MOUNT}/load_gen.py", "--target", url, "--rate", str(LOAD_RATE),
            "--duration", str(int(duration_s)), "--timeout", str(REQUEST_TIMEOUT_S), "--concurrency", "16"]
    lab.create_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(lab.labels)},
        "spec": {"restartPolicy": "Never", "volumes": [{"name": "loadgen", "configMap": {"name": LOADGEN_CONFIGMAP}}],
                 "containers": [{
                     "name": "load", "image": lab.profile.ray_image, "command": argv,
                     "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}],
                     "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}},
                     "volumeMounts": [{"name": "loadgen", "mountPath": LOADGEN_MOUNT, "readOnly": True}]}]}})
    return name


def load_seconds(lab, ns: str, pod: str) -> list[dict[str, Any]]:
    log = lab.core.read_namespaced_pod_log(pod, ns)
    return [e for e in parse_events(log) if e["event"] == "second"]


def load_window(seconds: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Requests started in [start, end): counts, availability, the worst second's p99."""
    picked = [s for s in seconds if s["window_start"] + 1 > start and s["window_start"] < end]
    ok = sum(s["ok"] for s in picked)
    failed = sum(s["fail"] for s in picked)
    p99 = [s["p99_ms"] for s in picked if s.get("p99_ms") is not None]
    failing = [s["second"] for s in picked if s["fail"]]
    return {"seconds": len(picked), "sent": ok + failed, "ok": ok, "failed": failed,
            "availability": round(ok / (ok + failed), 4) if ok + failed else None,
            "worst_second_p99_ms": max(p99) if p99 else None,
            "median_second_p99_ms": sorted(p99)[len(p99) // 2] if p99 else None,
            "failing_seconds": failing[:40]}


def per_second(seconds: list[dict[str, Any]], origin: float, end: float, lead_s: float = 10.0) -> list[list[Any]]:
    """Each second of load from ``lead_s`` before ``origin`` until ``end``:
    [seconds from the origin, availability, p99 latency in ms], for a timeline."""
    return [[round(s["window_start"] - origin, 1),
             round(s["ok"] / (s["ok"] + s["fail"]), 4) if s["ok"] + s["fail"] else None, s.get("p99_ms")]
            for s in seconds if origin - lead_s <= s["window_start"] < end]


@contextlib.contextmanager
def deleted_first(lab, ns: str, plural: str, name: str):
    """Deletes the Ray object at the end while its namespace (and its Redis)
    still exist, so KubeRay's GCS-FT Redis cleanup Job can run before the
    namespace goes (a terminating namespace admits no new Job, and the
    RayCluster's cleanup finalizer would then hold the namespace forever).

    A RayService is deleted orphaning its RayClusters, which are then deleted
    on their own: deleted with it, the RayService disappears first and Kueue's
    Job webhook refuses the cleanup Job (it cannot find the Job's owner's
    owner); deleted in the foreground, KubeRay still reconciles the dying
    RayService and creates a fresh pending RayCluster (measured, KubeRay
    v1.5.0)."""
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            lab.custom.delete_namespaced_custom_object("ray.io", "v1", ns, plural, name,
                                                       propagation_policy="Orphan" if plural == "rayservices" else None)
        with contextlib.suppress(WaitTimeout):
            wait_for(lambda: [o["metadata"]["name"] for o in lab.custom.list_namespaced_custom_object(
                "ray.io", "v1", ns, plural)["items"] if o["metadata"]["name"] == name],
                lambda left: not left, timeout=timeouts.OBJECT_DELETE, description=f"{plural} {ns}/{name} to be deleted")
        for cluster in lab.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters")["items"]:
            with contextlib.suppress(Exception):
                lab.custom.delete_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", cluster["metadata"]["name"])
        with contextlib.suppress(WaitTimeout):
            wait_for(lambda: lab.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters")["items"],
                     lambda items: not items, timeout=timeouts.OBJECT_DELETE,
                     description=f"the RayClusters of {ns} (and their Redis cleanup) to be deleted")
