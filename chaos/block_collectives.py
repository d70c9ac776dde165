"""Fault: a NetworkPolicy that drops worker-to-worker traffic.

The design's "someone locked down the namespace and broke training": a
security tightening admits traffic into GPU worker pods only from the head,
so the workers' collective (gloo/NCCL), object-manager and rendezvous traffic
to each other is dropped. Training must fail within the collective timeout
instead of hanging. :func:`documented_allow_policy` is the positive control:
the design's policy (workers accept traffic from their own namespace only,
metrics from the monitoring namespace), under which the same training runs.
"""
from __future__ import annotations

from typing import Any

from chaos import _kube

DENY_NAME = "rayproof-workers-from-head-only"
ALLOW_NAME = "rayproof-workers-same-namespace"
WORKERS = {"matchLabels": {"ray.io/node-type": "worker"}}
MONITORING_NAMESPACE_LABEL = {"kubernetes.io/metadata.name": "monitoring"}
METRICS_PORT = 8080  # Ray's Prometheus metrics port on every node (KubeRay's default)


def deny_policy(labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Workers accept traffic from head pods only (nothing from each other)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": DENY_NAME, "labels": dict(labels or {})},
            "spec": {"podSelector": WORKERS, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"ray.io/node-type": "head"}}}]}]}}


# The design's worker policy: default-deny ingress except from pods of the
# same namespace (GCS, object manager, collectives) and Ray's metrics port
# (METRICS_PORT) from the ``monitoring`` namespace.
DESIGN_WORKER_INGRESS = [{"from": [{"podSelector": {}}]},
                         {"from": [{"namespaceSelector": {"matchLabels": MONITORING_NAMESPACE_LABEL}}],
                          "ports": [{"protocol": "TCP", "port": METRICS_PORT}]}]


def documented_allow_policy(labels: dict[str, str] | None = None,
                            ingress: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The platform's documented worker policy: the workers of the namespace
    accept only ``ingress`` (default: :data:`DESIGN_WORKER_INGRESS`)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": ALLOW_NAME, "labels": dict(labels or {})},
            "spec": {"podSelector": WORKERS, "policyTypes": ["Ingress"],
                     "ingress": DESIGN_WORKER_INGRESS if ingress is None else ingress}}


def steady_state(kubeconfig: str, namespace: str, context: str = "") -> bool:
    """No policy of this module is in ``namespace``."""
    names = {p.metadata.name
             for p in _kube.networking(kubeconfig, context).list_namespaced_network_policy(namespace).items}
    return not names & {DENY_NAME}


def inject(kubeconfig: str, namespace: str, labels: dict[str, str] | None = None, context: str = "") -> str:
    """Apply the deny policy to the workers of ``namespace``; returns its name."""
    _kube.networking(kubeconfig, context).create_namespaced_network_policy(namespace, deny_policy(labels))
    return DENY_NAME


def allow(kubeconfig: str, namespace: str, labels: dict[str, str] | None = None,
          ingress: list[dict[str, Any]] | None = None, context: str = "") -> dict[str, Any]:
    """Apply the documented worker policy (NET-2); returns it as applied."""
    policy = documented_allow_policy(labels, ingress)
    _kube.networking(kubeconfig, context).create_namespaced_network_policy(namespace, policy)
    return policy


def revert(kubeconfig: str, namespace: str, context: str = "") -> list[str]:
    """Delete both policies where present; returns what was deleted."""
    net = _kube.networking(kubeconfig, context)
    return [name for name in (DENY_NAME, ALLOW_NAME)
            if _kube.ignore_missing(net.delete_namespaced_network_policy, name, namespace)]
