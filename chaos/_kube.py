"""The Kubernetes client the fault functions share."""
from __future__ import annotations

import functools
from typing import Any, Callable


@functools.lru_cache(maxsize=8)
def api(kubeconfig: str = "", context: str = "") -> Any:
    """An ``ApiClient`` for ``kubeconfig`` (empty: $KUBECONFIG, then ~/.kube/config)
    and its ``context`` (empty: the kubeconfig's current context)."""
    from kubernetes import config

    return config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig or None, context=context or None)


def core(kubeconfig: str, context: str = "") -> Any:
    from kubernetes import client

    return client.CoreV1Api(api(kubeconfig, context))


def custom(kubeconfig: str, context: str = "") -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(api(kubeconfig, context))


def networking(kubeconfig: str, context: str = "") -> Any:
    from kubernetes import client

    return client.NetworkingV1Api(api(kubeconfig, context))


def ignore_missing(call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Run a delete; True if it deleted something, False if it was already gone."""
    from kubernetes import client

    try:
        call(*args, **kwargs)
        return True
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def ray_pods(kubeconfig: str, namespace: str, cluster: str, node_type: str, context: str = "") -> list[Any]:
    """Pods of RayCluster ``cluster`` of ``node_type`` (head|worker), oldest first."""
    pods = core(kubeconfig, context).list_namespaced_pod(
        namespace, label_selector=f"ray.io/cluster={cluster},ray.io/node-type={node_type}").items
    return sorted((p for p in pods if p.metadata.deletion_timestamp is None),
                  key=lambda p: p.metadata.creation_timestamp)


def ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def holds_within(check: Callable[[], Any], within_s: float, description: str) -> bool:
    """True if ``check()`` holds now or becomes true within ``within_s`` seconds."""
    from core.timeouts import Tier
    from core.waiting import WaitTimeout, wait_for

    if not within_s:
        try:
            return bool(check())
        except Exception:  # noqa: BLE001 - a probe answers False rather than raising
            return False
    try:
        wait_for(check, timeout=Tier("chaos_probe", float(within_s), description), interval=1, description=description)
        return True
    except WaitTimeout:
        return False
