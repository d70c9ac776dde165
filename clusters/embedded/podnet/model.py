"""The few facts the pod network needs, read from Kubernetes objects in their API (camelCase JSON) shape.

The compilers take these plain values rather than API objects so they can be
unit-tested from literals, and so the watch layer stays a thin list/watch of
raw JSON.  ``from_api`` functions accept the dicts the API server returns (or
``ApiClient().sanitize_for_serialization(obj)`` of a client model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


@dataclass(frozen=True)
class ServicePort:
    name: str
    port: int
    protocol: str = "TCP"
    target_port: int | str | None = None
    node_port: int | None = None  # allocated by the API server for type NodePort/LoadBalancer


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    cluster_ip: str | None  # None: headless (clusterIP: None) or not yet assigned
    ports: tuple[ServicePort, ...] = ()
    type: str = "ClusterIP"
    headless: bool = False

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> "Service":
        meta, spec = _meta(obj), obj.get("spec") or {}
        ip = spec.get("clusterIP")
        headless = ip == "None"
        ports = tuple(ServicePort(p.get("name") or "", int(p["port"]), p.get("protocol") or "TCP", p.get("targetPort"),
                                  int(p["nodePort"]) if p.get("nodePort") else None)
                      for p in spec.get("ports") or [])
        return cls(meta.get("namespace") or "default", meta["name"], None if headless or not ip else ip, ports,
                   spec.get("type") or "ClusterIP", headless)


@dataclass(frozen=True)
class Endpoint:
    """One address of an EndpointSlice, with that slice's ports (name, protocol) -> port."""

    ip: str
    ports: Mapping[tuple[str, str], int]
    ready: bool = True
    hostname: str | None = None
    pod: str | None = None


def endpoints_from_slices(slices: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], list[Endpoint]]:
    """(namespace, service name) -> endpoints of all its IPv4 EndpointSlices.

    ``conditions.ready`` absent means ready (API doc of EndpointConditions).
    """
    out: dict[tuple[str, str], list[Endpoint]] = {}
    for sl in slices:
        meta = _meta(sl)
        svc = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if not svc or (sl.get("addressType") or "IPv4") != "IPv4":
            continue
        ports = {(p.get("name") or "", p.get("protocol") or "TCP"): int(p["port"])
                 for p in sl.get("ports") or [] if p.get("port") is not None}
        bucket = out.setdefault((meta.get("namespace") or "default", svc), [])
        for ep in sl.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            ref = ep.get("targetRef") or {}
            for addr in ep.get("addresses") or []:
                bucket.append(Endpoint(addr, ports, ready is not False, ep.get("hostname"),
                                       ref.get("name") if ref.get("kind", "Pod") == "Pod" else None))
    return out


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    ip: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    # container port name -> (port, protocol), for NetworkPolicy named ports
    named_ports: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    node: str | None = None  # spec.nodeName
    host_ports: Mapping[int, int] = field(default_factory=dict)  # TCP hostPort -> containerPort

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> "Pod":
        meta, spec, status = _meta(obj), obj.get("spec") or {}, obj.get("status") or {}
        named: dict[str, tuple[int, str]] = {}
        host: dict[int, int] = {}
        for c in spec.get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name"):
                    named[p["name"]] = (int(p["containerPort"]), p.get("protocol") or "TCP")
                if p.get("hostPort") and (p.get("protocol") or "TCP") == "TCP":
                    host[int(p["hostPort"])] = int(p["containerPort"])
        ip = status.get("podIP")
        # A finished pod's address goes back to the pool and may be reused by
        # another pod: it must no longer count as this pod's.
        if status.get("phase") in ("Succeeded", "Failed") or spec.get("hostNetwork"):
            ip = None
        return cls(meta.get("namespace") or "default", meta["name"], ip, dict(meta.get("labels") or {}), named,
                   spec.get("nodeName"), host)


@dataclass(frozen=True)
class Namespace:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> "Namespace":
        meta = _meta(obj)
        labels = dict(meta.get("labels") or {})
        # The API server adds this label to every namespace; objects fed by
        # hand may lack it, and namespaceSelectors commonly use it.
        labels.setdefault(NAMESPACE_NAME_LABEL, meta["name"])
        return cls(meta["name"], labels)
