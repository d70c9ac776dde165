"""Fault: the head of a running RayCluster is pushed past its memory limit.

The design's "Ray Data job materialising too many objects on the head": a
RayJob submitted to the *running* cluster (``spec.clusterSelector``) whose
driver -- which Ray runs on the head -- keeps putting objects into the head's
object store and copies in its heap (``workloads/head_pressure.py``), toward
``target_bytes``. The head container's memory limit ends it ``OOMKilled``;
the kubelet restarts it. Revert deletes the pressure job.

The OOM probe judges the head container against its state before the fault:
a new termination (restart count above the count before), ended
``OOMKilled``. An ``OOMKilled`` left over from an earlier restart is not this
fault's. The count before is the experiment's ``head_restarts_before`` when
given, otherwise what :func:`inject` recorded on the pressure job
(:data:`RESTARTS_BEFORE_ANNOTATION`).
"""
from __future__ import annotations

import shlex
import time
from typing import Any

from chaos import _kube, rayjob

PRESSURE_PROGRAM = "/opt/rayproof/workloads/head_pressure.py"
# On the pressure RayJob: the head container's restart count when it was submitted.
RESTARTS_BEFORE_ANNOTATION = "rayproof.io/head-restarts-before"


def head_restarts(kubeconfig: str, namespace: str, cluster: str, context: str = "") -> dict[str, Any]:
    """The head pod's container restart count and last termination reason."""
    heads = _kube.ray_pods(kubeconfig, namespace, cluster, "head", context)
    if not heads:
        return {"pod": None, "restarts": None, "last_reason": None, "ready": False}
    pod = heads[0]
    status = next(iter(pod.status.container_statuses or []), None)
    last = status.last_state.terminated if status and status.last_state else None
    return {"pod": pod.metadata.name, "restarts": status.restart_count if status else None,
            "last_reason": last.reason if last else None, "last_exit_code": last.exit_code if last else None,
            "ready": _kube.ready(pod)}


def steady_state(kubeconfig: str, namespace: str, cluster: str, within_s: float = 0, context: str = "") -> bool:
    """The head pod of ``cluster`` is Ready (within ``within_s``)."""
    return _kube.holds_within(lambda: bool(head_restarts(kubeconfig, namespace, cluster, context)["ready"]), within_s,
                              f"the head pod of RayCluster {namespace}/{cluster} to be Ready")


def oom_killed_since(head: dict[str, Any], restarts_before: int) -> bool:
    """The head container restarted since it had ``restarts_before`` restarts,
    and its last instance ended ``OOMKilled``."""
    return (head.get("restarts") or 0) > restarts_before and head.get("last_reason") == "OOMKilled"


def recorded_restarts_before(kubeconfig: str, namespace: str, pressure_job: str, context: str = "") -> int:
    """The head's restart count that :func:`inject` recorded on ``pressure_job``."""
    job = _kube.custom(kubeconfig, context).get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs",
                                                                         pressure_job)
    value = (job["metadata"].get("annotations") or {}).get(RESTARTS_BEFORE_ANNOTATION)
    if value is None:
        raise ValueError(f"RayJob {namespace}/{pressure_job} carries no {RESTARTS_BEFORE_ANNOTATION} annotation; "
                         "pass head_restarts_before")
    return int(value)


def wait_oom_killed(kubeconfig: str, namespace: str, cluster: str, within_s: float, restarts_before: int = -1,
                    pressure_job: str = "", context: str = "") -> dict[str, Any]:
    """Wait until the head container has restarted since the fault (restart
    count above ``restarts_before``; negative: the count :func:`inject`
    recorded on ``pressure_job``) and its last termination is ``OOMKilled``;
    returns the head's state, the count before and the elapsed time
    (``reached`` False on timeout)."""
    began = time.monotonic()
    before = int(restarts_before)
    if before < 0:
        before = recorded_restarts_before(kubeconfig, namespace, pressure_job, context)
    done = _kube.holds_within(lambda: oom_killed_since(head_restarts(kubeconfig, namespace, cluster, context), before),
                              within_s, f"the head container of {namespace}/{cluster} to restart (more than {before} "
                                        "restarts) after ending OOMKilled")
    result = {"reached": done, "elapsed_s": round(time.monotonic() - began, 1), "restarts_before": before,
              "head": head_restarts(kubeconfig, namespace, cluster, context)}
    if not done and pressure_job:  # what became of the pressure instead, while its job still exists
        result["pressure_job"] = pressure_job_status(kubeconfig, namespace, pressure_job, context)
    return result


def pressure_job_status(kubeconfig: str, namespace: str, name: str, context: str = "") -> dict[str, Any]:
    """The pressure RayJob's status (Ray's job status and message), or why it could not be read."""
    try:
        return rayjob.read_status(kubeconfig, namespace, name, context)
    except Exception as exc:  # noqa: BLE001 - a missing job is an answer here
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def pressure_job(name: str, cluster: str, target_bytes: int, max_seconds: int = 240,
                 labels: dict[str, str] | None = None, restarts_before: int | None = None) -> dict[str, Any]:
    argv = ["python", PRESSURE_PROGRAM, "--target-bytes", str(int(target_bytes)), "--max-seconds", str(max_seconds)]
    annotations = {} if restarts_before is None else {RESTARTS_BEFORE_ANNOTATION: str(int(restarts_before))}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "labels": dict(labels or {}), "annotations": annotations},
            "spec": {"entrypoint": " ".join(shlex.quote(a) for a in argv),
                     "clusterSelector": {"ray.io/cluster": cluster}}}


def inject(kubeconfig: str, namespace: str, cluster: str, target_bytes: int, name: str = "",
           labels: dict[str, str] | None = None, context: str = "") -> dict[str, Any]:
    """Submit the pressure job to ``cluster``; returns its name and the head's
    state before (its restart count is also recorded on the job)."""
    before = head_restarts(kubeconfig, namespace, cluster, context)
    job = name or f"head-pressure-{int(time.time()) % 100000}"
    _kube.custom(kubeconfig, context).create_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs",
        pressure_job(job, cluster, target_bytes, labels=labels, restarts_before=before["restarts"]))
    return {"rayjob": job, "head_before": before, "submitted_at": time.time()}


def revert(kubeconfig: str, namespace: str, name: str, context: str = "") -> bool:
    """Delete the pressure job (its driver may already be gone with the head)."""
    return _kube.ignore_missing(_kube.custom(kubeconfig, context).delete_namespaced_custom_object,
                                "ray.io", "v1", namespace, "rayjobs", name)
