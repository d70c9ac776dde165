"""Each Kubernetes clause whose limits come from the profile fails on a platform the profile describes as broken.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against an embedded
platform with the default settings and a certification profile that describes
a misconfigured platform (a 1800 s collective timeout, no GCS fault
tolerance, the dashboard on a NodePort, ...), and requires the clause's
outcome to be ``failed`` with a message that names the cause. The platform is
one of its own, not the session's, so these runs do not queue behind the
clauses in the worker that owns the session's platform.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.selftest.clause_runs import PLATFORMS_GROUP, expect_failure, misconfigured_platform, run_clause

pytestmark = [pytest.mark.slow, PLATFORMS_GROUP]


@pytest.fixture(scope="module")
def default_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; an embedded platform with the default settings; taken down at teardown."""
    yield from misconfigured_platform(tmp_path_factory, "selftest-default", {})


def test_net1_fails_when_the_collective_timeout_is_left_at_30_minutes(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, "conformance/network/test_network.py::test_policy_blocking_collectives_fails_training_fast",
                     profile={"training": {"collectiveTimeout": "1800s"}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "above the fail-fast bound")


def test_trn1_fails_when_the_collective_timeout_is_left_at_30_minutes(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, "conformance/training/test_recovery.py::"
                               "test_worker_preempted_mid_allreduce_resumes_from_checkpoint",
                     profile={"training": {"collectiveTimeout": "1800s"}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "above the fail-fast bound")


def test_sec1_fails_when_the_dashboard_is_on_a_node_port(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, "conformance/operations/test_operations.py::test_ray_dashboard_not_exposed_without_authentication",
                     profile={"ray": {"headServiceType": "NodePort"}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "is type NodePort")


def test_sec2_fails_when_namespaces_are_left_open_to_each_other(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    # The profile says the platform isolates namespaces itself; the embedded one does not.
    row = run_clause(tmp_path, "conformance/operations/test_operations.py::test_no_ray_node_joins_another_teams_gcs",
                     profile={"tenancy": {"namespaceIsolation": "platform"}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "joined team A's GCS")


def test_ops1_fails_when_finished_clusters_are_kept_for_ten_minutes(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, "conformance/operations/test_operations.py::test_finished_rayjob_cluster_is_torn_down",
                     profile={"operations": {"ttlSecondsAfterFinished": 600, "teardownWithin": "20s"}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "stayed held by an idle cluster")


def test_adm5_fails_when_queues_never_preempt(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, "conformance/admission/test_preemption.py::"
                               "test_higher_priority_job_preempts_whole_gang_and_victim_resumes",
                     profile={"kueue": {"preemption": "Never"}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "did not preempt")


def test_gcs1_fails_without_gcs_fault_tolerance(default_platform, tmp_path) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, "conformance/gcs/test_gcs.py::test_head_oom_keeps_rayservice_available",
                     profile={"gcsFaultTolerance": {"enabled": False}},
                     platform=name, platform_profile=platform_profile)
    # Without FT the restarted head has lost the applications: either requests
    # fail past the target, or the applications never come back.
    expect_failure(row, "below the target", "apps RUNNING after the head OOM")
