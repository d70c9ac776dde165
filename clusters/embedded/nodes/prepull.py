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
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from clusters.embedded.nodes.images import PAUSE_IMAGE
from rayproof import timeouts
from rayproof.waiting import wait_for

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


def deploy(api_client: Any, images: Sequence[str], nodes: int, progress: Callable[[str], None]) -> None:
    """Create the DaemonSet of ``images`` and wait until it is Ready on all ``nodes`` (every image pulled
    onto every node)."""
    if not images:
        return
    from kubernetes import client

    apps = client.AppsV1Api(api_client)
    began = time.monotonic()
    apps.create_namespaced_daemon_set(NAMESPACE, daemonset(images))

    def ready() -> tuple[int, int]:
        status = apps.read_namespaced_daemon_set(NAME, NAMESPACE).status
        return status.number_ready or 0, status.desired_number_scheduled or 0
    wait_for(ready, lambda r: r[1] >= nodes and r[0] >= r[1], timeout=timeouts.IMAGE_PULL,
             description=f"{NAMESPACE}/{NAME} Ready on {nodes} nodes, each having pulled {', '.join(images)}: "
                         "(ready, scheduled) pods")
    progress(f"node images pre-pulled onto {nodes} nodes in {time.monotonic() - began:.1f}s: {', '.join(images)}")
