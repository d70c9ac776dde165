"""Fault: one worker of a gang is late to become Ready, or never becomes Ready.

The design's straggler: three workers up in 90 s, the fourth stuck pulling a
CUDA image. The RayJob is written as usual, then one worker replica is moved
into a worker group of its own (same container; Ray sees one more node of the
same shape) that is either delayed (``delay_s``: an init container that
waits, as a slow image pull holds a pod before its containers start) or
unpullable (``delay_s`` None: an image in the reserved ``.invalid`` domain,
which no registry serves). Revert deletes the RayJob.
"""
from __future__ import annotations

import copy
import shlex
from typing import Any

from chaos import _kube

STRAGGLER_GROUP = "straggler"
UNPULLABLE_IMAGE = "registry.invalid/rayproof/unpullable:0"


def with_straggler(rayjob: dict[str, Any], delay_s: float | None) -> dict[str, Any]:
    """``rayjob`` with one replica of its first worker group moved into a delayed
    (``delay_s`` seconds) or unpullable (None) group of its own."""
    job = copy.deepcopy(rayjob)
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    base = groups[0]
    if int(base["replicas"]) < 2:
        raise ValueError("a straggler needs a worker group of at least 2 replicas")
    for key in ("replicas", "minReplicas", "maxReplicas"):
        base[key] = int(base[key]) - 1
    late = copy.deepcopy(base)
    late["groupName"] = STRAGGLER_GROUP
    for key in ("replicas", "minReplicas", "maxReplicas"):
        late[key] = 1
    pod = late["template"]["spec"]
    container = pod["containers"][0]
    if delay_s is None:
        container["image"] = UNPULLABLE_IMAGE
    else:
        wait = f"echo 'pulling (straggler)'; sleep {float(delay_s)}"  # sleep-ok: the simulated pull inside the pod
        pod.setdefault("initContainers", []).insert(0, {
            "name": "slow-pull", "image": container["image"], "command": ["/bin/bash", "-c", wait],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}})
    groups.append(late)
    return job


def inject(kubeconfig: str, namespace: str, rayjob: dict[str, Any], delay_s: float | None = None,
           context: str = "") -> str:
    """Create ``rayjob`` with a straggler (see :func:`with_straggler`); returns its name."""
    body = with_straggler(rayjob, delay_s)
    _kube.custom(kubeconfig, context).create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", body)
    return body["metadata"]["name"]


def observe(kubeconfig: str, namespace: str, name: str, wait_for: str, within_s: float,
            context: str = "") -> dict[str, Any]:
    """Wait for the outcome: ``finished`` (the RayJob ended), ``finished_or_evicted``
    (that, or its Workload was evicted first) or ``requeued`` (its Workload was
    evicted for PodsReadyTimeout and then requeued)."""
    from chaos import rayjob

    if wait_for in ("finished", "finished_or_evicted"):
        return rayjob.wait_state(kubeconfig, namespace, name, "finished", within_s, context=context,
                                 unless_evicted=wait_for == "finished_or_evicted")
    if wait_for == "requeued":
        evicted = rayjob.workload_condition(kubeconfig, namespace, name, "Evicted", within_s, reason="PodsReadyTimeout",
                                            context=context)
        requeued = rayjob.workload_condition(kubeconfig, namespace, name, "Requeued", within_s, context=context) \
            if evicted["reached"] else {"reached": False, "elapsed_s": 0, "conditions": []}
        return {"evicted": evicted, "requeued": requeued}
    raise ValueError(f"wait_for must be 'finished', 'finished_or_evicted' or 'requeued', not {wait_for!r}")


def revert(kubeconfig: str, namespace: str, name: str, context: str = "") -> bool:
    return _kube.ignore_missing(_kube.custom(kubeconfig, context).delete_namespaced_custom_object,
                                "ray.io", "v1", namespace, "rayjobs", name)


def describe(delay_s: float | None) -> str:
    return "unpullable image " + shlex.quote(UNPULLABLE_IMAGE) if delay_s is None else f"{delay_s:g} s pull delay"
