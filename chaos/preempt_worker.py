"""Fault: a pod of a training cluster is deleted mid-all-reduce.

What a spot reclaim or a preemption does to a running gang: the pod goes
without a grace period, its raylet and its Ray Train worker die in the middle
of a collective. KubeRay recreates the pod (the worker group keeps its
replica count); Ray Train is expected to notice, restart the worker group and
resume from the latest checkpoint. The same fault on the head
(``node_type="head"``) takes the driver with it: the RayJob must retry and
training resume from shared storage. Nothing to revert: the platform heals.
"""
from __future__ import annotations

import time
from typing import Any

from chaos import _kube


def steady_state(kubeconfig: str, namespace: str, cluster: str, workers: int, within_s: float = 0,
                 context: str = "") -> bool:
    """Every one of the ``workers`` worker pods of ``cluster`` exists and is
    Ready (within ``within_s``: after the fault, the platform's time to heal)."""
    def whole() -> bool:
        pods = _kube.ray_pods(kubeconfig, namespace, cluster, "worker", context)
        return len(pods) == int(workers) and all(_kube.ready(p) for p in pods)
    return _kube.holds_within(whole, within_s, f"{workers} Ready worker pods of RayCluster {namespace}/{cluster}")


def inject(kubeconfig: str, namespace: str, cluster: str, node_type: str = "worker",
           context: str = "") -> dict[str, Any]:
    """Delete the newest ``node_type`` (worker|head) pod of ``cluster`` with grace period 0."""
    pods = _kube.ray_pods(kubeconfig, namespace, cluster, node_type, context)
    if not pods:
        raise RuntimeError(f"RayCluster {namespace}/{cluster} has no {node_type} pod to preempt")
    victim = pods[-1]
    _kube.core(kubeconfig, context).delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)
    return {"pod": victim.metadata.name, "node": victim.spec.node_name, "pod_ip": victim.status.pod_ip,
            "deleted_at": time.time()}


def revert(kubeconfig: str, namespace: str, cluster: str, context: str = "") -> str:
    """Nothing to undo: KubeRay replaces the pod. Returns what it found."""
    pods = _kube.ray_pods(kubeconfig, namespace, cluster, "worker", context)
    return f"{len(pods)} worker pods of {cluster}"
