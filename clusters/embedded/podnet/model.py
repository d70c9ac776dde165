"""The few facts the NetworkPolicy compiler needs, read from Kubernetes objects in their API (camelCase JSON) shape.

The compilers take these plain values rather than API objects so they can be
unit-tested from literals, and so the watch layer stays a thin list/watch of
raw JSON.  ``from_api`` functions accept the dicts the API server returns (or
``ApiClient().sanitize_for_serialization(obj)`` of a client model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    ip: str | None
    labels: Mapping[str, str] = field(default_factory=dict)
    # container port name -> (port, protocol), for NetworkPolicy named ports
    named_ports: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    node: str | None = None  # spec.nodeName

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> "Pod":
        meta, spec, status = _meta(obj), obj.get("spec") or {}, obj.get("status") or {}
        named: dict[str, tuple[int, str]] = {}
        for c in spec.get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name"):
                    named[p["name"]] = (int(p["containerPort"]), p.get("protocol") or "TCP")
        ip = status.get("podIP")
        # A finished pod's address goes back to the pool and may be reused by
        # another pod: it must no longer count as this pod's.
        if status.get("phase") in ("Succeeded", "Failed") or spec.get("hostNetwork"):
            ip = None
        return cls(meta.get("namespace") or "default", meta["name"], ip, dict(meta.get("labels") or {}), named,
                   spec.get("nodeName"))


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
