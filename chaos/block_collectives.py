"""Fault: a NetworkPolicy that drops worker-to-worker traffic.

The design's "someone locked down the namespace and broke training": a
security tightening lets GPU worker pods send traffic to the head only (and
to DNS), so the workers' collective (gloo/NCCL), object-manager and
rendezvous traffic to each other is dropped. Training must fail within the
collective timeout instead of hanging.

The policy restricts the workers' *egress*. NetworkPolicies only ever add
allowed traffic, and a platform's own ingress policies (the reference
platform's documented worker policy admits every pod of the namespace) would
allow what an ingress deny tried to drop; a connection needs both the
sender's egress and the receiver's ingress allowed, so an egress restriction
drops worker-to-worker traffic whatever ingress the platform allows, and
leaves the platform's policies untouched.
"""
from __future__ import annotations

from typing import Any

from chaos import _kube

DENY_NAME = "rayproof-workers-to-head-only"
WORKERS = {"matchLabels": {"ray.io/node-type": "worker"}}
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]


def deny_policy(labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Workers may send traffic to head pods and DNS only (nothing to each other)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": DENY_NAME, "labels": dict(labels or {})},
            "spec": {"podSelector": WORKERS, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"podSelector": {"matchLabels": {"ray.io/node-type": "head"}}}]},
                                {"ports": DNS_PORTS}]}}


def steady_state(kubeconfig: str, namespace: str, context: str = "") -> bool:
    """The deny policy is not in ``namespace``."""
    names = {p.metadata.name
             for p in _kube.networking(kubeconfig, context).list_namespaced_network_policy(namespace).items}
    return DENY_NAME not in names


def inject(kubeconfig: str, namespace: str, labels: dict[str, str] | None = None, context: str = "") -> str:
    """Apply the deny policy to the workers of ``namespace``; returns its name."""
    policy = deny_policy(labels)  # in the suite's own namespace; revert() removes it
    net = _kube.networking(kubeconfig, context)
    net.create_namespaced_network_policy(namespace, policy)  # platform-owned-ok: this policy is the fault itself
    return DENY_NAME


def revert(kubeconfig: str, namespace: str, context: str = "") -> list[str]:
    """Delete the deny policy where present; returns what was deleted."""
    net = _kube.networking(kubeconfig, context)
    return [DENY_NAME] if _kube.ignore_missing(net.delete_namespaced_network_policy, DENY_NAME, namespace) else []
