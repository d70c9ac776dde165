"""Benchmarks: they print figures and the machine they ran on (:func:`machine`); they assert nothing about time."""
from __future__ import annotations

import os
import platform


def machine() -> dict:
    import psutil
    import ray
    import torch

    return {"host": platform.node(), "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30),
            "kernel": platform.release(), "ray": ray.__version__, "torch": torch.__version__,
            "load_average": os.getloadavg()}
