"""RayJob actions and probes the experiments share: submit one, wait for a state.

Waits go through :func:`core.waiting.wait_for` with ``within_s`` as a
named bound, and return what was last observed with the elapsed time, so the
experiment journal records the outcome either way.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from chaos import _kube
from core import kueue
from core.timeouts import CONTROLLER_RECONCILE, Tier
from core.waiting import WaitTimeout, wait_for

# What each named state means on a RayJob's status (and its Kueue Workload).
STATES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "finished": lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
    "running": lambda s: s.get("jobStatus") == "RUNNING",
    # The driver has run (it may already have ended): a fail-fast bound counts from here.
    "started": lambda s: s.get("jobStatus") in ("RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
    or s.get("jobDeploymentStatus") in ("Complete", "Failed"),
    "retrying_or_finished": lambda s: s.get("jobDeploymentStatus") in ("Retrying", "Complete", "Failed")
    or int(s.get("failed") or 0) > 0,
}


def none_hanging(kubeconfig: str, namespace: str, context: str = "") -> bool:
    """Steady state: no RayJob in ``namespace`` is running (none exist, or all
    have ended or wait suspended). A RayJob left Running after its method's
    wait is the hang the fail-fast clauses are about."""
    jobs = _kube.custom(kubeconfig, context).list_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs").get("items", [])
    return not [j for j in jobs if (j.get("status") or {}).get("jobDeploymentStatus") == "Running"]


def submit(kubeconfig: str, namespace: str, rayjob: dict[str, Any], context: str = "") -> str:
    _kube.custom(kubeconfig, context).create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", rayjob)
    return str(rayjob["metadata"]["name"])


def workloads_of(kubeconfig: str, namespace: str, rayjob: str, context: str = "") -> list[dict[str, Any]]:
    """The Kueue Workloads owned by RayJob ``rayjob``."""
    items = _kube.custom(kubeconfig, context).list_namespaced_custom_object(
        kueue.GROUP, kueue.VERSION, namespace, "workloads").get("items", [])
    return [dict(w) for w in kueue.owned_by_rayjob(items, rayjob)]


# What a RayJob's status says, as the experiments report it.
STATUS_FIELDS = ("jobStatus", "jobDeploymentStatus", "reason", "message", "failed", "succeeded", "rayClusterName")


def wait_state(kubeconfig: str, namespace: str, name: str, state: str, within_s: float,
               context: str = "", unless_evicted: bool = False) -> dict[str, Any]:
    """Wait until RayJob ``name`` is in ``state`` (a key of STATES); returns
    ``{"reached": bool, "elapsed_s", "status", "cause", "evicted"}`` (never
    raises on timeout). A queued job still without a Kueue Workload after
    CONTROLLER_RECONCILE will never be admitted: that ends the wait early, its
    ``cause`` saying so (checked once). With ``unless_evicted`` an eviction of
    its Workload ends the wait too (``evicted``: that condition)."""
    began = time.monotonic()
    tier = Tier(f"rayjob_{state}", float(within_s), f"RayJob {state}")
    queue_checked, cause, evicted = False, None, None

    def observe() -> dict[str, Any]:
        nonlocal queue_checked, cause, evicted
        job = _kube.custom(kubeconfig, context).get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)
        st = job.get("status") or {}
        if unless_evicted:
            evicted = next((c for w in workloads_of(kubeconfig, namespace, name, context)
                            for c in (w.get("status") or {}).get("conditions") or []
                            if c["type"] == "Evicted" and c["status"] == "True"), None)
        if not queue_checked and time.monotonic() - began >= CONTROLLER_RECONCILE.seconds and not STATES[state](st):
            queue_checked = True
            if kueue.QUEUE_LABEL in (job["metadata"].get("labels") or {}) \
                    and not workloads_of(kubeconfig, namespace, name, context):
                cause = kueue.unmanaged_rayjob(namespace, name, CONTROLLER_RECONCILE.seconds)
        return st

    try:
        st = wait_for(observe, lambda s: STATES[state](s) or cause is not None or evicted is not None, timeout=tier,
                      interval=1, description=f"RayJob {namespace}/{name} to be {state}")
        reached = STATES[state](st)
    except WaitTimeout as exc:
        st, reached = exc.last_value if isinstance(exc.last_value, dict) else {}, False
    return {"reached": reached, "elapsed_s": round(time.monotonic() - began, 1), "cause": cause,
            "evicted": evicted and {k: evicted.get(k) for k in ("reason", "message", "lastTransitionTime")},
            "status": {k: st.get(k) for k in STATUS_FIELDS}}


def read_status(kubeconfig: str, namespace: str, name: str, context: str = "") -> dict[str, Any]:
    """RayJob ``name``'s status as KubeRay reports it (the fields :func:`wait_state` returns)."""
    st = _kube.custom(kubeconfig, context).get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs",
                                                                        name).get("status") or {}
    return {k: st.get(k) for k in STATUS_FIELDS}


def reason_matches(found: str | None, reason: str | tuple[str, ...] | None) -> bool:
    """Whether a condition's ``found`` reason is ``reason`` (or one of them); any reason where none is asked."""
    if not reason:
        return True
    return found in ((reason,) if isinstance(reason, str) else reason)


def workload_condition(kubeconfig: str, namespace: str, rayjob: str, condition: str, within_s: float,
                       reason: str | tuple[str, ...] = "", context: str = "") -> dict[str, Any]:
    """Wait until the Kueue Workload of ``rayjob`` has ``condition`` True (with
    ``reason``, or one of them, when given); returns ``{"reached", "elapsed_s", "conditions"}``."""
    began = time.monotonic()
    tier = Tier(f"workload_{condition.lower()}", float(within_s), f"Workload {condition}")

    def observe() -> list[dict[str, Any]]:
        return [c for w in workloads_of(kubeconfig, namespace, rayjob, context)
                for c in (w.get("status") or {}).get("conditions") or []]

    def done(conds: list[dict[str, Any]]) -> bool:
        return any(c["type"] == condition and c["status"] == "True" and reason_matches(c.get("reason"), reason)
                   for c in conds)
    try:
        conds = wait_for(observe, done, timeout=tier, interval=1,
                         description=f"Workload of RayJob {namespace}/{rayjob} to have {condition} "
                                     f"{reason if isinstance(reason, str) else ' or '.join(reason)}".strip())
        reached = True
    except WaitTimeout as exc:
        conds, reached = exc.last_value if isinstance(exc.last_value, list) else [], False
    return {"reached": reached, "elapsed_s": round(time.monotonic() - began, 1),
            "conditions": [{k: c.get(k) for k in ("type", "status", "reason", "message", "lastTransitionTime")}
                           for c in conds]}


def driver_events(kubeconfig: str, namespace: str, rayjob: str, context: str = "") -> list[dict[str, Any]]:
    """The events the driver of ``rayjob`` printed (every submitter pod's log, oldest first)."""
    from core.events import parse_events

    api = _kube.core(kubeconfig, context)
    pods = sorted(api.list_namespaced_pod(namespace, label_selector=f"job-name={rayjob}").items,
                  key=lambda p: p.metadata.creation_timestamp)
    logs = []
    for pod in pods:
        if pod.status.phase != "Pending":
            with contextlib.suppress(Exception):  # a pod going away mid-read: its log is read next time
                logs.append(api.read_namespaced_pod_log(pod.metadata.name, namespace))
    return parse_events("\n".join(logs))
