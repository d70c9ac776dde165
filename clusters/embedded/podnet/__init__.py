"""The embedded platform's pod network: the router between the nodes, its NetworkPolicy engine and the
API server's way in to pods and kubelets.

Public API (see each module for the why):

* :class:`PodNetwork` (``network.py``): ``open()`` (the router namespace), ``apply_table``, ``ruleset``,
  ``namespaces``, ``close()``; the address plan (``POD_CIDR``, ``SERVICE_CIDR``, ``ROUTER_IP``,
  ``DNS_IP``, ``GATEWAY``, ``DOMAIN``).
* :class:`PodNetworkController` (``controller.py``): watches Pods, Namespaces and NetworkPolicies and
  keeps the router's policy rules in step; ``start()``, ``stop()``, ``close()``.
* :class:`ClusterProxy` (``proxy.py``), run by the controller: an HTTP CONNECT proxy on
  ``cluster_proxy_socket(state_dir)`` for kube-apiserver's egress selector
  (:func:`egress_selector_config`), the only way into the pod network from the root namespace.
* The pure policy compiler for tests: :func:`compile_policies`.

The nodes (``nodes/``) link to the router (``nodes/fabric.py``); kube-proxy in each node translates
Service addresses and serves node ports, CoreDNS pods serve DNS, kube-router judges NetworkPolicy in
each node. The retired node agent's pod network also did those three in the router.
"""
from __future__ import annotations

from clusters.embedded.podnet._host import PodNetworkUnavailable, check_available
from clusters.embedded.podnet.controller import POD_NETWORK_SYNC, ClusterState, PodNetworkController, cluster_proxy_socket
from clusters.embedded.podnet.model import Namespace, Pod
from clusters.embedded.podnet.network import (
    DNS_IP,
    DOMAIN,
    GATEWAY,
    POD_CIDR,
    ROUTER_IP,
    SERVICE_CIDR,
    PodNetwork,
)
from clusters.embedded.podnet.policy import PolicyError, compile_policies
from clusters.embedded.podnet.proxy import ClusterProxy, egress_selector_config

__all__ = [
    "DNS_IP", "DOMAIN", "GATEWAY", "POD_CIDR", "POD_NETWORK_SYNC", "ROUTER_IP", "SERVICE_CIDR",
    "ClusterProxy", "ClusterState", "Namespace", "Pod", "PodNetwork", "PodNetworkController",
    "PodNetworkUnavailable", "PolicyError", "check_available", "cluster_proxy_socket", "compile_policies",
    "egress_selector_config",
]
