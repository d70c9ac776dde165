"""Head memory clause (WL-MEM-1): the head-pressure workload against a head memory limit."""
from __future__ import annotations

import sys

import pytest

from core import timeouts
from core.waiting import wait_for
from fixtures.events import EventLog
from fixtures.local_ray import LocalRayCluster

HEAD_MEMORY_LIMIT = 1536 * 2**20  # the head container's limit
PRESSURE_TARGET = 4 * HEAD_MEMORY_LIMIT


def check_head_pressure_is_oom_killed(cluster: LocalRayCluster, evidence, *, target_bytes: int) -> None:
    """The head-pressure driver on the head is killed by the head's memory limit and reports what it held."""
    argv = [sys.executable, "-m", "workloads.head_pressure", f"--target-bytes={target_bytes}"]
    proc = cluster.popen(cluster.head, argv, "pressure.log")
    rc = wait_for(proc.poll, lambda r: r is not None, timeout=timeouts.SERVE_APP,
                  description="head-pressure driver to exit (target reached or killed)")
    log = EventLog(cluster.workdir / "pressure.log")
    last = log.last("pressure")
    evidence.record("exit_code", rc)
    evidence.record("held_bytes_at_end", last and last["held_bytes"])
    cgroup = cluster.head.cgroup
    if cgroup is not None:
        evidence.record("head_oom_kills", cgroup.oom_kills())
        evidence.record("head_peak_bytes", cgroup.max_usage_bytes())
    assert rc in (-9, 137), (
        f"head-pressure driver exited {rc} instead of being OOM-killed (SIGKILL/137); "
        f"last progress: {last}; tail:\n{log.tail(5)}")
    assert cgroup is not None and cgroup.oom_kills() >= 1, "the kernel recorded no OOM kill in the head's memory cgroup"
    assert last is not None and 0 < last["held_bytes"] < target_bytes, f"no progress reported before the kill: {last}"


@pytest.mark.clause("WL-MEM-1")
def test_head_pressure_is_oom_killed(local_ray, evidence):
    """A driver on the head that materialises objects toward 4x the head's memory limit MUST be OOM-killed by
    that limit (exit 137) and MUST have reported how much it held before the kill."""
    cluster = local_ray(head_cpus=1, head_memory_limit=HEAD_MEMORY_LIMIT)
    check_head_pressure_is_oom_killed(cluster, evidence, target_bytes=PRESSURE_TARGET)
