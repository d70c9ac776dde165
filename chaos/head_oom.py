"""Fault: the head of a running RayCluster is pushed past its memory limit.

The design's "Ray Data job materialising too many objects on the head": a
RayJob submitted to the *running* cluster (``spec.clusterSelector``) whose
driver -- which Ray runs on the head -- keeps putting objects into the head's
object store and copies in its heap (``workloads/head_pressure.py``), toward
``target_bytes``. The head container's memory limit ends it ``OOMKilled``;
the kubelet restarts it. Revert deletes the pressure job.
"""
from __future__ import annotations

import shlex
import time
from typing import Any

from chaos import _kube

PRESSURE_PROGRAM = "/opt/rayproof/workloads/head_pressure.py"


def head_restarts(kubeconfig: str, namespace: str, cluster: str) -> dict[str, Any]:
    """The head pod's container restart count and last termination reason."""
    heads = _kube.ray_pods(kubeconfig, namespace, cluster, "head")
    if not heads:
        return {"pod": None, "restarts": None, "last_reason": None, "ready": False}
    pod = heads[0]
    status = next(iter(pod.status.container_statuses or []), None)
    last = status.last_state.terminated if status and status.last_state else None
    return {"pod": pod.metadata.name, "restarts": status.restart_count if status else None,
            "last_reason": last.reason if last else None, "last_exit_code": last.exit_code if last else None,
            "ready": _kube.ready(pod)}


def steady_state(kubeconfig: str, namespace: str, cluster: str, within_s: float = 0) -> bool:
    """The head pod of ``cluster`` is Ready (within ``within_s``)."""
    return _kube.holds_within(lambda: bool(head_restarts(kubeconfig, namespace, cluster)["ready"]), within_s,
                              f"the head pod of RayCluster {namespace}/{cluster} to be Ready")


def wait_oom_killed(kubeconfig: str, namespace: str, cluster: str, within_s: float) -> dict[str, Any]:
    """Wait until the head container's last termination is ``OOMKilled``;
    returns the head's state and the elapsed time (``reached`` False on timeout)."""
    began = time.monotonic()
    done = _kube.holds_within(lambda: head_restarts(kubeconfig, namespace, cluster)["last_reason"] == "OOMKilled",
                              within_s, f"the head container of {namespace}/{cluster} to be OOMKilled")
    return {"reached": done, "elapsed_s": round(time.monotonic() - began, 1),
            "head": head_restarts(kubeconfig, namespace, cluster)}


def pressure_job(name: str, cluster: str, target_bytes: int, max_seconds: int = 240,
                 labels: dict[str, str] | None = None) -> dict[str, Any]:
    argv = ["python", PRESSURE_PROGRAM, "--target-bytes", str(int(target_bytes)), "--max-seconds", str(max_seconds)]
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"entrypoint": " ".join(shlex.quote(a) for a in argv),
                     "clusterSelector": {"ray.io/cluster": cluster}}}


def inject(kubeconfig: str, namespace: str, cluster: str, target_bytes: int, name: str = "",
           labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Submit the pressure job to ``cluster``; returns its name and the head's state before."""
    before = head_restarts(kubeconfig, namespace, cluster)
    job = name or f"head-pressure-{int(time.time()) % 100000}"
    _kube.custom(kubeconfig).create_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", pressure_job(job, cluster, target_bytes, labels=labels))
    return {"rayjob": job, "head_before": before, "submitted_at": time.time()}


def revert(kubeconfig: str, namespace: str, name: str) -> bool:
    """Delete the pressure job (its driver may already be gone with the head)."""
    return _kube.ignore_missing(_kube.custom(kubeconfig).delete_namespaced_custom_object,
                                "ray.io", "v1", namespace, "rayjobs", name)
