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
           context: str = "", rayjob: str = "", collective: str = "", within_s: float = 0) -> dict[str, Any]:
    """Delete a ``node_type`` (worker|head) pod of ``cluster`` with grace period 0.

    Without ``collective``, the newest such pod, at once. With it (an op the
    training brackets, e.g. ``all_reduce``) and ``rayjob`` (whose driver's
    output carries the ranks' events), the worker pod of the highest rank
    (never rank 0, whose extra compute the others wait for inside the
    collective), deleted as soon as that rank is seen entering ``collective``
    (within ``within_s``); what was seen is returned with the deletion."""
    pods = _kube.ray_pods(kubeconfig, namespace, cluster, node_type, context)
    if not pods:
        raise RuntimeError(f"RayCluster {namespace}/{cluster} has no {node_type} pod to preempt")
    victim, seen = pods[-1], dict[str, Any]()
    if collective:
        victim, seen = _rank_inside(kubeconfig, namespace, pods, rayjob, collective, float(within_s), context)
    _kube.core(kubeconfig, context).delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)
    return {"pod": victim.metadata.name, "node": victim.spec.node_name, "pod_ip": victim.status.pod_ip,
            "deleted_at": time.time(), **seen}


def _rank_inside(kubeconfig: str, namespace: str, pods: list[Any], rayjob: str, collective: str, within_s: float,
                 context: str) -> tuple[Any, dict[str, Any]]:
    """The pod of the highest rank, once its driver's output shows that rank
    entering ``collective``: (pod, {rank, entered: the begin event, seen_after_s})."""
    from chaos.rayjob import driver_events
    from core.timeouts import Tier
    from core.waiting import wait_for

    by_ip = {p.status.pod_ip: p for p in pods}
    tier = Tier("collective_entered", within_s, f"a rank of RayJob {rayjob} entering {collective}")
    # Only an entry seen after the first look counts (the log up to then is history).
    first_look: list[int] = []

    def latest() -> tuple[Any, dict[str, Any] | None]:
        events = driver_events(kubeconfig, namespace, rayjob, context)
        ranks = {e["rank"]: by_ip[e["ip"]] for e in events if e["event"] == "rank" and e.get("ip") in by_ip}
        if not ranks or max(ranks) == 0:
            return None, None
        rank = max(ranks)
        own = [e for e in events if e["event"] == "collective" and e["rank"] == rank]
        if not first_look:
            first_look.append(len(own))
        return (rank, ranks[rank]), (own[-1] if len(own) > first_look[0] else None)

    (rank, pod), entered = wait_for(
        latest, lambda v: v[1] is not None and v[1]["phase"] == "begin" and v[1]["op"] == collective,
        timeout=tier, interval=0.1,
        description=f"the highest rank of RayJob {namespace}/{rayjob} (never rank 0) seen entering {collective}")
    assert entered is not None  # what the wait waited for
    # On one machine's clock (the embedded platform): how late the driver's output showed the entry.
    return pod, {"rank": rank, "entered": entered, "seen_after_s": round(time.time() - entered["ts"], 3)}


def revert(kubeconfig: str, namespace: str, cluster: str, context: str = "") -> str:
    """Nothing to undo: KubeRay replaces the pod. Returns what it found."""
    pods = _kube.ray_pods(kubeconfig, namespace, cluster, "worker", context)
    return f"{len(pods)} worker pods of {cluster}"
