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
    return evidence.record(EVIDENCE_KEY, {"what": what, "gpu_seconds": round(gpu_seconds, 1),
                                          "gpu_hours": round(hours, 4), "amount": round(hours * price, 4),
                                          "currency": profile["cost"]["currency"], "gpu_hour_price": price})
