"""Kubernetes resource quantities, and the values the downward API exposes.

Shared by the environment (``resourceFieldRef``), downward-API volumes and
the memory cgroup limit, so the three agree on what ``limits.memory: 1Gi``
means, exactly as the kubelet's ``resource.Quantity`` arithmetic does.
"""
from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any, Mapping

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(text: Any) -> Decimal:
    """The value of a quantity string (``"500m"`` -> 0.5, ``"1Gi"`` -> 1073741824)."""
    if isinstance(text, (int, float)):
        return Decimal(str(text))
    m = _QUANTITY.match(str(text).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def container_resource(container: Mapping[str, Any], resource: str, allocatable: Mapping[str, str]) -> Decimal:
    """``limits.cpu``/``requests.memory``/... of a container as the kubelet
    resolves them: an unset limit is the node's allocatable."""
    kind, _, name = resource.partition(".")
    res = container.get("resources") or {}
    value = (res.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (res.get("limits") or {}).get(name)  # API defaulting: request = limit
    if value is None:
        if kind == "limits":
            value = allocatable.get(name, "0")
        else:
            value = "0"
    return parse_quantity(value)


def format_resource(value: Decimal, resource: str, divisor: Any = None) -> str:
    """The downward-API text of a resource: ceil(value / divisor) (divisor 1
    by default), as ``ExtractContainerResourceValue`` computes it."""
    div = parse_quantity(divisor) if divisor not in (None, "", 0, "0") else Decimal(1)
    if resource.endswith(".cpu"):
        # The kubelet divides milli-values, then rounds up.
        milli = math.ceil(value * 1000)
        dmilli = max(1, int(div * 1000))
        return str(math.ceil(milli / dmilli))
    return str(math.ceil(value / div))


def memory_limit_bytes(container: Mapping[str, Any]) -> int | None:
    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return None if limit is None else int(parse_quantity(limit))
