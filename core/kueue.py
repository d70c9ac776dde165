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


# Where an upstream Kueue install keeps its Configuration (the manager's
# Deployment mounts it): the platform's own waitForPodsReady, readable
# through the API by anyone granted `get` on that one ConfigMap.
CONFIG_NAMESPACE, CONFIG_MAP, CONFIG_KEY = "kueue-system", "kueue-manager-config", "controller_manager_config.yaml"


def configured_wait_for_pods_ready(api: Any) -> dict[str, Any]:
    """Kueue's live waitForPodsReady as its ConfigMap says: ``{"source",
    "enabled", "timeout_s", "backoff_base_s"}``, or ``{"source": None,
    "why": ...}`` where it cannot be read (then the profile's promise is taken
    on trust). In config v1beta2 the section's presence enables it; in
    v1beta1 its ``enable`` field does."""
    import yaml
    from kubernetes import client

    from core.schema import parse_duration

    where = f"ConfigMap {CONFIG_NAMESPACE}/{CONFIG_MAP}"
    try:
        cm = client.CoreV1Api(api).read_namespaced_config_map(CONFIG_MAP, CONFIG_NAMESPACE)
        config = yaml.safe_load((cm.data or {})[CONFIG_KEY]) or {}
    except client.ApiException as exc:
        return {"source": None, "why": f"{where} could not be read ({exc.status} {exc.reason})"}
    except (KeyError, yaml.YAMLError) as exc:
        return {"source": None, "why": f"{where} has no readable {CONFIG_KEY} ({type(exc).__name__})"}
    wait = config.get("waitForPodsReady")
    v1beta1 = str(config.get("apiVersion", "")).endswith("/v1beta1")
    enabled = wait is not None and (bool(wait.get("enable")) if v1beta1 else wait.get("enable", True) is not False)
    requeuing = (wait or {}).get("requeuingStrategy") or {}
    return {"source": where, "apiVersion": config.get("apiVersion"), "enabled": enabled,
            # Upstream defaults where a field is left out (Kueue's config API).
            "timeout_s": parse_duration(str((wait or {}).get("timeout") or "5m")) if enabled else None,
            "backoff_base_s": float(requeuing.get("backoffBaseSeconds", 60)) if enabled else None}


def promise_disagreements(configured: dict[str, Any], timeout_s: float | None,
                          backoff_base_s: float | None) -> list[str]:
    """Where Kueue's live waitForPodsReady (:func:`configured_wait_for_pods_ready`)
    differs from what the profile promises; [] where it agrees or cannot be read."""
    if configured.get("source") is None:
        return []
    where = configured["source"]
    if not configured["enabled"]:
        return [f"{where} has waitForPodsReady off while the profile promises a {timeout_s:g} s timeout"] \
            if timeout_s is not None else []
    out = []
    if timeout_s is None:
        out.append(f"{where} has waitForPodsReady on (timeout {configured['timeout_s']:g} s) while the profile "
                   "says it is off")
    elif abs(configured["timeout_s"] - timeout_s) > 0.5:
        out.append(f"{where} sets waitForPodsReady.timeout {configured['timeout_s']:g} s, the profile promises "
                   f"{timeout_s:g} s")
    if backoff_base_s is not None and abs(configured["backoff_base_s"] - backoff_base_s) > 0.5:
        out.append(f"{where} sets requeuingStrategy.backoffBaseSeconds {configured['backoff_base_s']:g} s, the "
                   f"profile promises backoffBase {backoff_base_s:g} s")
    return out
