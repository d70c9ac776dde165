"""Cluster DNS of the real nodes: CoreDNS as pods behind the ``kube-dns`` Service (``coredns.yaml``).

The kubelets' ``clusterDNS`` is the Service's address (``DNS_IP``); each node's
kube-proxy sends a pod's query to a CoreDNS pod, through the pod network like
any pod-to-pod traffic, so NetworkPolicy judges DNS as it does on a real
cluster (an egress policy that allows no port 53 cuts a pod's DNS). CoreDNS
watches the API server through ``kubernetes.default`` (the API server
advertises the router's address, where the node relay listens). The router
serves no DNS (the retired node agent's pod network served it there).
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Callable

import yaml

from clusters.embedded.nodes.images import COREDNS_IMAGE
from clusters.embedded.podnet.network import DNS_IP
from core import timeouts
from core.waiting import wait_for

MANIFEST = Path(__file__).with_name("coredns.yaml")
NAMESPACE = "kube-system"
DEPLOYMENT = "coredns"


def documents(image: str = COREDNS_IMAGE, dns_ip: str = DNS_IP) -> list[dict[str, Any]]:
    """The manifest's objects with the image and the Service address filled in."""
    text = string.Template(MANIFEST.read_text()).substitute(image=image, dns_ip=dns_ip)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def deploy(api_client: Any, progress: Callable[[str], None]) -> None:
    """Create CoreDNS's objects and wait until every replica is Ready (it answers ``/ready``, so it has
    listed Services and EndpointSlices from the API server)."""
    from kubernetes import client, utils

    for doc in documents():
        utils.create_from_dict(api_client, doc)
    apps = client.AppsV1Api(api_client)

    def replicas() -> tuple[int, int]:
        d = apps.read_namespaced_deployment(DEPLOYMENT, NAMESPACE)
        return d.status.ready_replicas or 0, d.spec.replicas
    ready, want = wait_for(replicas, lambda r: r[0] >= r[1], timeout=timeouts.POD_START,
                           description=f"CoreDNS ({NAMESPACE}/{DEPLOYMENT}) Ready: (ready, wanted) replicas")
    progress(f"cluster DNS: CoreDNS Ready ({ready}/{want} replicas) behind kube-dns {DNS_IP}")
