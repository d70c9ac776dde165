"""What a failure mode costs on the platform: the GPU time it held without
progress, priced at the profile's ``cost.gpuHourPrice``.

Each clause that measures such time records it as its ``idle_cost`` evidence;
the certificate sums them at its top ("what these failure modes cost per
incident on this platform").
"""
from __future__ import annotations

from typing import Any

EVIDENCE_KEY = "idle_cost"  # the clause evidence the certificate sums


def record_idle_cost(profile: Any, evidence: Any, gpu_seconds: float, what: str) -> dict[str, Any]:
    """Record ``gpu_seconds`` of GPUs held without progress, with ``what`` held
    them, in GPU-hours and money."""
    price = float(profile["cost"]["gpuHourPrice"])
    hours = gpu_seconds / 3600
    recorded: dict[str, Any] = evidence.record(EVIDENCE_KEY, {"what": what, "gpu_seconds": round(gpu_seconds, 1),
                                          "gpu_hours": round(hours, 4), "amount": round(hours * price, 4),
                                          "currency": profile["cost"]["currency"], "gpu_hour_price": price})
    return recorded


def per_incident(clauses: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPU time each measured failure mode held without progress, and its
    price, from the clauses' idle_cost evidence; summed where one currency."""
    incidents = [{"clause": c["id"], **c["evidence"][EVIDENCE_KEY]} for c in clauses
                 if "gpu_hours" in (c["evidence"].get(EVIDENCE_KEY) or {})]
    currencies = sorted({i["currency"] for i in incidents})
    return {"incidents": incidents, "gpu_hours": round(sum(i["gpu_hours"] for i in incidents), 4),
            "amount": round(sum(i["amount"] for i in incidents), 2) if len(currencies) == 1 else None,
            "currency": currencies[0] if len(currencies) == 1 else ", ".join(currencies) or None}


HEADLINE = "What these failure modes cost per incident on this platform:"


def total(spent: dict[str, Any]) -> str:
    """The sum of :func:`per_incident` in words, for the certificate's top."""
    money = f"{spent['amount']:.2f} {spent['currency']}, " if spent["amount"] is not None else ""
    return f"{money}{spent['gpu_hours']:g} GPU-hours held without progress"
