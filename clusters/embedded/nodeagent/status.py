"""Pod phase and conditions, computed from container statuses as the kubelet does.

Pure functions over the API's JSON shapes, so they can be checked against
upstream's tables without running anything: :func:`pod_phase` follows
``kubelet_pods.go: getPhase`` (Kubernetes 1.35) case by case, the condition
helpers follow ``pkg/kubelet/status/generate.go``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

KUBELET_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def _status_of(statuses: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((s for s in statuses if s.get("name") == name), None)


def is_sidecar(container: Mapping[str, Any]) -> bool:
    """A restartable init container (native sidecar, ``restartPolicy: Always``)."""
    return container.get("restartPolicy") == "Always"


def pod_phase(spec: Mapping[str, Any], init_statuses: Sequence[Mapping[str, Any]],
              statuses: Sequence[Mapping[str, Any]], *, terminal: bool, initialized_once: bool) -> str:
    """The pod phase (``getPhase``)."""
    restart_policy = spec.get("restartPolicy") or "Always"
    pending_init = pending_sidecars = failed_init = 0
    for c in spec.get("initContainers") or []:
        if is_sidecar(c):
            continue
        s = _status_of(init_statuses, c["name"])
        state = (s or {}).get("state") or {}
        last = ((s or {}).get("lastState") or {}).get("terminated")
        if s is None or "running" in state:
            pending_init += 1
        elif "terminated" in state:
            if state["terminated"].get("exitCode", 0) != 0:
                failed_init += 1
        elif "waiting" in state:
            if last is not None:
                if last.get("exitCode", 0) != 0:
                    failed_init += 1
            else:
                pending_init += 1
        else:
            pending_init += 1
    unknown = running = waiting = stopped = succeeded = 0
    for c in spec.get("initContainers") or []:
        if not is_sidecar(c):
            continue
        s = _status_of(init_statuses, c["name"])
        if s is None:
            unknown += 1
            continue
        state = s.get("state") or {}
        if "running" in state:
            if not s.get("started"):
                pending_sidecars += 1
            running += 1
        elif "terminated" in state:
            pass
        elif "waiting" in state:
            if not (s.get("lastState") or {}).get("terminated"):
                pending_sidecars += 1
        else:
            pending_sidecars += 1
            unknown += 1
    for c in spec.get("containers") or []:
        s = _status_of(statuses, c["name"])
        if s is None:
            unknown += 1
            continue
        state = s.get("state") or {}
        if "running" in state:
            running += 1
        elif "terminated" in state:
            stopped += 1
            if state["terminated"].get("exitCode", 0) == 0:
                succeeded += 1
        elif "waiting" in state:
            if (s.get("lastState") or {}).get("terminated"):
                stopped += 1
            else:
                waiting += 1
        else:
            unknown += 1
    if failed_init > 0 and restart_policy == "Never":
        return "Failed"
    if pending_init > 0 or (pending_sidecars > 0 and not initialized_once) or waiting > 0:
        return "Pending"
    if running > 0 and unknown == 0:
        return "Running"
    if running == 0 and stopped > 0 and unknown == 0:
        if terminal:
            return "Succeeded" if stopped == succeeded else "Failed"
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    return "Pending"


def _cond(kind: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
    c: dict[str, Any] = {"type": kind, "status": "True" if ok else "False"}
    if not ok and reason:
        c["reason"] = reason
    if not ok and message:
        c["message"] = message
    return c


def initialized_condition(spec: Mapping[str, Any], init_statuses: Sequence[Mapping[str, Any]],
                          phase: str) -> dict[str, Any]:
    if not spec.get("initContainers"):
        return _cond("Initialized", True)
    incomplete = []
    for c in spec["initContainers"]:
        s = _status_of(init_statuses, c["name"])
        state = (s or {}).get("state") or {}
        if is_sidecar(c):
            if not (s and s.get("started")):
                incomplete.append(c["name"])
        elif not ("terminated" in state and state["terminated"].get("exitCode") == 0):
            incomplete.append(c["name"])
    if not incomplete or phase == "Succeeded":
        return _cond("Initialized", True)
    return _cond("Initialized", False, "ContainersNotInitialized",
                 f"containers with incomplete status: [{' '.join(incomplete)}]")


def containers_ready_condition(spec: Mapping[str, Any], init_statuses: Sequence[Mapping[str, Any]],
                               statuses: Sequence[Mapping[str, Any]], phase: str) -> dict[str, Any]:
    unknown, unready = [], []
    for c in spec.get("initContainers") or []:
        if not is_sidecar(c):
            continue
        s = _status_of(init_statuses, c["name"])
        if s is None:
            unknown.append(c["name"])
        elif not s.get("ready"):
            unready.append(c["name"])
    for c in spec.get("containers") or []:
        s = _status_of(statuses, c["name"])
        if s is None:
            unknown.append(c["name"])
        elif not s.get("ready"):
            unready.append(c["name"])
    if phase == "Succeeded" and not unknown:
        return _cond("ContainersReady", False, "PodCompleted")
    parts = []
    if unknown:
        parts.append(f"containers with unknown status: [{' '.join(unknown)}]")
    if unready:
        parts.append(f"containers with unready status: [{' '.join(unready)}]")
    if parts:
        return _cond("ContainersReady", False, "ContainersNotReady", ", ".join(parts))
    return _cond("ContainersReady", True)


def ready_condition(containers_ready: Mapping[str, Any], spec: Mapping[str, Any],
                    conditions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if containers_ready["status"] != "True":
        return _cond("Ready", False, containers_ready.get("reason", ""), containers_ready.get("message", ""))
    bad = []
    for gate in spec.get("readinessGates") or []:
        kind = gate["conditionType"]
        c = next((c for c in conditions if c.get("type") == kind), None)
        if c is None:
            bad.append(f'corresponding condition of pod readiness gate "{kind}" does not exist.')
        elif c.get("status") != "True":
            bad.append(f'the status of pod readiness gate "{kind}" is not "True", but {c.get("status")}')
    if bad:
        return _cond("Ready", False, "ReadinessGatesNotReady", ", ".join(bad))
    return _cond("Ready", True)


def merge_conditions(previous: Sequence[Mapping[str, Any]], ours: Sequence[dict[str, Any]],
                     now: str) -> list[dict[str, Any]]:
    """Conditions owned by others kept as they are; ours keep their
    ``lastTransitionTime`` while their status is unchanged; PodScheduled is
    ensured (the kubelet adds it for pods that lack it)."""
    prev = {c.get("type"): c for c in previous}
    out: list[dict[str, Any]] = [dict(c) for c in previous if c.get("type") not in KUBELET_CONDITIONS]
    if "PodScheduled" not in prev:
        out.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now})
    for c in ours:
        old = prev.get(c["type"])
        c = dict(c)
        c["lastProbeTime"] = None
        c["lastTransitionTime"] = old.get("lastTransitionTime") if old and old.get("status") == c["status"] else now
        out.append(c)
    return out
