"""Fault: one worker of a gang is late to become Ready, or never becomes Ready.

The design's straggler: three workers up in 90 s, the fourth stuck pulling a
CUDA image. The RayJob is written as usual, then one worker replica is moved
into a worker group of its own (same container; Ray sees one more node of the
same shape) that is either delayed (``delay_s``) or unpullable (``delay_s``
None: an image in the reserved ``.invalid`` domain, which no registry
serves). The delay is the pod's first init container: the platform's slow
image (``slow_image``, the certification profile's ``kueue.slowPullImage``,
named for this delay and a fresh nonce), which kubelet really pulls for that
long before anything in the pod starts; or, on a platform without one, the
worker's own image waiting that long inside the pod (a simulated pull).
Revert deletes the RayJob.
"""
from __future__ import annotations

import copy
import re
import uuid
from typing import Any

from chaos import _kube

STRAGGLER_GROUP = "straggler"
UNPULLABLE_IMAGE = "registry.invalid/rayproof/unpullable:0"
SLOW_PULL_CONTAINER = "slow-pull"  # the straggler's first init container
# How kubelet's events name that container (involvedObject.fieldPath).
SLOW_PULL_FIELD_PATH = f"spec.initContainers{{{SLOW_PULL_CONTAINER}}}"


# The reasons of a Workload's Evicted condition at its waitForPodsReady timeout:
# requeued (PodsReadyTimeout), or deactivated instead once its requeues reach
# requeuingStrategy.backoffLimitCount (Kueue then gives the deactivation's reason).
EVICTED_AT_PODS_READY_TIMEOUT = ("PodsReadyTimeout", "DeactivatedDueToRequeuingLimitExceeded")

def slow_pull_container(image: str, delay_s: float, slow_image: str = "") -> dict[str, Any]:
    """An init container that holds its pod ``delay_s`` seconds: the pull of
    ``slow_image`` (a reference with ``{seconds}`` and ``{nonce}``), or
    without one, ``image`` waiting that long."""
    resources = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}
    if slow_image:
        reference = slow_image.format(seconds=f"{float(delay_s):g}", nonce=uuid.uuid4().hex[:12])
        return {"name": SLOW_PULL_CONTAINER, "image": reference, "imagePullPolicy": "IfNotPresent",
                "resources": resources}
    wait = f"echo 'pulling (straggler)'; sleep {float(delay_s)}"  # sleep-ok: the simulated pull inside the pod
    return {"name": SLOW_PULL_CONTAINER, "image": image, "command": ["/bin/bash", "-c", wait], "resources": resources}


def with_straggler(rayjob: dict[str, Any], delay_s: float | None, slow_image: str = "") -> dict[str, Any]:
    """``rayjob`` with one replica of its first worker group moved into a delayed
    (``delay_s`` seconds; see :func:`slow_pull_container`) or unpullable (None)
    group of its own."""
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
        pod.setdefault("initContainers", []).insert(0, slow_pull_container(container["image"], delay_s, slow_image))
    groups.append(late)
    return job


def inject(kubeconfig: str, namespace: str, rayjob: dict[str, Any], delay_s: float | None = None,
           slow_image: str = "", context: str = "") -> str:
    """Create ``rayjob`` with a straggler (see :func:`with_straggler`); returns its name."""
    body = with_straggler(rayjob, delay_s, slow_image)
    _kube.custom(kubeconfig, context).create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", body)
    return str(body["metadata"]["name"])


def observe(kubeconfig: str, namespace: str, name: str, wait_for: str, within_s: float,
            context: str = "") -> dict[str, Any]:
    """Wait for the outcome: ``finished`` (the RayJob ended), ``finished_or_evicted``
    (that, or its Workload was evicted first) or ``requeued`` (its Workload was
    evicted at its PodsReady timeout and then requeued)."""
    from chaos import rayjob

    if wait_for in ("finished", "finished_or_evicted"):
        return rayjob.wait_state(kubeconfig, namespace, name, "finished", within_s, context=context,
                                 unless_evicted=wait_for == "finished_or_evicted")
    if wait_for == "requeued":
        evicted = rayjob.workload_condition(kubeconfig, namespace, name, "Evicted", within_s,
                                            reason=EVICTED_AT_PODS_READY_TIMEOUT, context=context)
        requeued = rayjob.workload_condition(kubeconfig, namespace, name, "Requeued", within_s, context=context) \
            if evicted["reached"] else {"reached": False, "elapsed_s": 0, "conditions": []}
        return {"evicted": evicted, "requeued": requeued}
    raise ValueError(f"wait_for must be 'finished', 'finished_or_evicted' or 'requeued', not {wait_for!r}")


def revert(kubeconfig: str, namespace: str, name: str, context: str = "") -> bool:
    return _kube.ignore_missing(_kube.custom(kubeconfig, context).delete_namespaced_custom_object,
                                "ray.io", "v1", namespace, "rayjobs", name)


def pull_seconds(message: str) -> float | None:
    """The pull time in kubelet's ``Successfully pulled image "x" in 1m1.795s (...)`` (a Go duration)."""
    found = re.search(r"Successfully pulled image \S+ in (?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)(ms|s))?( |$)", message)
    if not found or not any(found.groups()[:4]):
        return None
    hours, minutes, value, unit, _ = found.groups()
    seconds = float(value or 0) / (1000 if unit == "ms" else 1)
    return round(int(hours or 0) * 3600 + int(minutes or 0) * 60 + seconds, 1)


def pulls(kubeconfig: str, namespace: str, context: str = "") -> list[dict[str, Any]]:
    """Kubelet's ``Pulled`` and ``Failed`` events of the straggler group's pods in ``namespace``:
    pod, container (the event's fieldPath), reason, kubelet's message and a pull's seconds (None: the
    image was present, or it failed)."""
    events = _kube.core(kubeconfig, context).list_namespaced_event(namespace).items
    return sorted(({"pod": e.involved_object.name, "container": e.involved_object.field_path, "reason": e.reason,
                    "message": (e.message or "")[:300], "seconds": pull_seconds(e.message or "")}
                   for e in events if e.reason in ("Pulled", "Failed")
                   and f"-{STRAGGLER_GROUP}-" in (e.involved_object.name or "")),
                  key=lambda p: (p["pod"], p["reason"], p["message"]))
