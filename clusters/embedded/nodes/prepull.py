"""Node images pre-warmed at ``up``: the design's fix for slow pulls ("pre-warm node images via
DaemonSet cache-puller"), as the reference platform's operators run it.

The profile's ``nodes.prepullImages`` (the golden templates' Ray image by
default) are init containers of one DaemonSet in ``kube-system``, each
running ``true`` (so each image must hold one), then the sandbox image holds
the pod; kubelet pulls every image onto every node before the pod is Ready,
and ``up`` waits for that. A team's first Ray pod on a node then starts from
a warm image, and a straggler (ADM-3) is late by its own slow pull, not by a
cold 6.5 GB pull beside it. The DaemonSet stays, so a node that joins later
is warmed too; its pods request no CPU: a node keeps its whole CPU for the
teams' pods (one millicore was enough to keep a 1-CPU Ray worker off a
2-CPU node that held a 1-CPU head, and UPG-1's gang from every node).

Before the DaemonSet, ``up`` warms the nodes one at a time (a pod on each
running ``true`` in every image, deleted once it succeeded) and has the
platform share each node's unpacked layers with the first node's
(``sharedlayers.py``) before the next pulls. So this machine holds at most
two unpacked copies of the Ray image at any moment rather than one per node,
and the DaemonSet's pods then find every image present.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from clusters.embedded.nodes.images import PAUSE_IMAGE
from core import timeouts
from core.waiting import wait_for

NAMESPACE = "kube-system"
NAME = "image-prepuller"
_TINY = {"requests": {"cpu": "0", "memory": "8Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}


def daemonset(images: Sequence[str]) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": NAME}
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": labels},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
            "initContainers": [{"name": f"pull-{i}", "image": image, "command": ["true"], "resources": _TINY}
                               for i, image in enumerate(images)],
            "containers": [{"name": "hold", "image": PAUSE_IMAGE, "resources": _TINY}],
            "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 1,
        }}},
    }


def warm_up_pod(images: Sequence[str], node: str) -> dict[str, Any]:
    """A pod that pulls ``images`` onto ``node`` and ends (``true`` in each)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"image-warm-up-{node}", "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/name": "image-warm-up"}},
        "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": f"pull-{i}", "image": image, "command": ["true"], "resources": _TINY}
                                for i, image in enumerate(images)]},
    }


def _phase_and_containers(core: Any, name: str) -> tuple[str, list[str]]:
    status = core.read_namespaced_pod(name, NAMESPACE).status
    said = []
    for c in status.container_statuses or []:
        state = c.state.waiting or c.state.terminated
        reason, message = getattr(state, "reason", None) or "running", getattr(state, "message", None) or ""
        said.append(f"{c.name}: {reason} {message}".strip())
    return status.phase, said


def deploy(api_client: Any, images: Sequence[str], nodes: Sequence[str], progress: Callable[[str], None],
           after_each_node: Callable[[str], str]) -> None:
    """Pull ``images`` onto ``nodes`` one node at a time, calling ``after_each_node`` with the node's
    name (it says what it did) once the node holds them; then create the DaemonSet of ``images`` and wait until it is Ready
    on every node."""
    if not images:
        return
    from kubernetes import client

    core, apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
    began = time.monotonic()
    for node in nodes:
        pod = warm_up_pod(images, node)
        name = pod["metadata"]["name"]
        pulled_from = time.monotonic()
        core.create_namespaced_pod(NAMESPACE, pod)
        try:
            phase, containers = wait_for(
                lambda: _phase_and_containers(core, name), lambda seen: seen[0] in ("Succeeded", "Failed"),
                timeout=timeouts.IMAGE_PULL,
                description=f"{NAMESPACE}/{name} to pull {', '.join(images)} onto {node} and run: "
                            "(phase, containers' states)")
        finally:
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
        if phase == "Failed":
            raise RuntimeError(f"pulling {', '.join(images)} onto {node} failed: {containers}")
        progress(f"node images pulled onto {node} in {time.monotonic() - pulled_from:.1f}s; {after_each_node(node)}")
    apps.create_namespaced_daemon_set(NAMESPACE, daemonset(images))

    def ready() -> tuple[int, int]:
        status = apps.read_namespaced_daemon_set(NAME, NAMESPACE).status
        return status.number_ready or 0, status.desired_number_scheduled or 0
    wait_for(ready, lambda r: r[1] >= len(nodes) and r[0] >= r[1], timeout=timeouts.IMAGE_PULL,
             description=f"{NAMESPACE}/{NAME} Ready on {len(nodes)} nodes, each having pulled {', '.join(images)}: "
                         "(ready, scheduled) pods")
    progress(f"node images pre-pulled onto {len(nodes)} nodes in {time.monotonic() - began:.1f}s: {', '.join(images)}")
