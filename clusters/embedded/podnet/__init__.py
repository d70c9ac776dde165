"""The embedded platform's pod network: routed pods, services, cluster DNS and NetworkPolicy.

Public API (see each module for the why):

* :class:`PodNetwork` (``network.py``): ``open()``, ``attach(pod_key) -> PodAttachment``,
  ``detach(pod_key)``, ``resolv_conf(namespace)``, ``close()``; :func:`exec_prefix`.
* :class:`PodNetworkController` (``controller.py``): watches the API server and keeps
  service rules, DNS and policy rules in step; ``start()``, ``stop()``, ``close()``.
* :class:`ClusterProxy` (``proxy.py``), run by the controller: an HTTP CONNECT proxy on
  ``cluster_proxy_socket(state_dir)`` for kube-apiserver's egress selector
  (:func:`egress_selector_config`), the only way into the pod network from the root namespace.
* :class:`NodePortForwarder` (``nodeports.py``), run by the controller: ``127.0.0.1:<nodePort>`` of
  NodePort/LoadBalancer services, forwarded in userspace to their cluster IP inside the router.
* Pure compilers for tests: :func:`compile_services`, :func:`compile_policies`, :func:`build_zone`,
  :func:`compile_node_ports`.
"""
from __future__ import annotations

from clusters.embedded.podnet._host import PodNetworkUnavailable, check_available
from clusters.embedded.podnet.controller import POD_NETWORK_SYNC, ClusterState, PodNetworkController, cluster_proxy_socket
from clusters.embedded.podnet.dns import DnsServer, build_zone, resolv_conf
from clusters.embedded.podnet.model import Endpoint, Namespace, Pod, Service, ServicePort, endpoints_from_slices
from clusters.embedded.podnet.network import (
                                                 DNS_IP,
                                                 GATEWAY,
                                                 POD_CIDR,
                                                 ROUTER_IP,
                                                 SERVICE_CIDR,
                                                 PodAttachment,
                                                 PodNetwork,
                                                 exec_prefix,
)
from clusters.embedded.podnet.nodeports import NODE_IP, NodePortForwarder, NodePortTarget, compile_node_ports
from clusters.embedded.podnet.policy import PolicyError, compile_policies
from clusters.embedded.podnet.proxy import ClusterProxy, egress_selector_config
from clusters.embedded.podnet.services import compile_services

__all__ = [
    "DNS_IP", "GATEWAY", "NODE_IP", "POD_CIDR", "POD_NETWORK_SYNC", "ROUTER_IP", "SERVICE_CIDR",
    "ClusterProxy", "ClusterState", "DnsServer", "Endpoint", "Namespace", "NodePortForwarder", "NodePortTarget", "Pod",
    "PodAttachment", "PodNetwork", "PodNetworkController", "PodNetworkUnavailable", "PolicyError", "Service",
    "ServicePort", "build_zone", "check_available", "cluster_proxy_socket", "compile_node_ports", "compile_policies",
    "compile_services",
    "egress_selector_config", "endpoints_from_slices", "exec_prefix", "resolv_conf",
]
