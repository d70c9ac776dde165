"""Kueue's API as the suite reads it: its group and version, the labels a
team puts on a job, and which Workload belongs to a RayJob."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def owned_by_rayjob(workloads: Sequence[Mapping[str, Any]], rayjob: str) -> list[Mapping[str, Any]]:
    """The Kueue Workloads among ``workloads`` that RayJob ``rayjob`` owns."""
    return [w for w in workloads if any(o.get("kind") == "RayJob" and o.get("name") == rayjob
                                        for o in w["metadata"].get("ownerReferences") or [])]


def unmanaged_rayjob(namespace: str, rayjob: str, waited_s: float) -> str:
    """Why a queued RayJob without a Kueue Workload will never run."""
    return (f"Kueue created no Workload for RayJob {namespace}/{rayjob} within {waited_s:g} s although it names a "
            "LocalQueue: Kueue does not manage RayJobs on this platform (is the ray.io/rayjob integration "
            "enabled?), so nothing will ever admit the suspended job")
