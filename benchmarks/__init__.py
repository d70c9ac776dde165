"""Benchmarks: they print figures and the machine they ran on (:func:`machine`); they assert nothing about time."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> dict:
    import psutil
    import ray
    import torch

    return {"host": platform.node(), "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30),
            "kernel": platform.release(), "ray": ray.__version__, "torch": torch.__version__,
            "load_average": os.getloadavg()}


def host_leftovers() -> dict[str, set[str]]:
    """The suite's network namespaces, cgroups and mounts on this machine now."""
    from core import cgroups
    from fixtures import netns

    groups = {str(p) for root in (cgroups.V1_ROOT, cgroups.V2_ROOT) if root.is_dir()
              for p in root.glob("rayproof-*")}
    mounts = {line.split(" - ")[0].split(" ", 4)[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if "rayproof" in line}
    return {"network namespaces": set(netns.list_namespaces("rayproof-")), "cgroups": groups, "mounts": mounts}
