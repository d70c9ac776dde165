"""Each Kubernetes clause fails, with a message naming the cause, on a platform that breaks it.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against an embedded
platform started with the matching misconfiguration of its own (Kueue's
waitForPodsReady off or shorter than a healthy image pull, a CNI that does not
enforce NetworkPolicy, Kueue not managing RayJobs), and requires the clause's
outcome to be ``failed`` with a message that names the cause. Changes that
need no platform of their own (a golden template, or, until the platform owns
its queues and policies, a profile that describes them) are in
``test_configured_platform_clauses_fail.py``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.selftest.clause_runs import expect_failure, misconfigured_platform, platforms_group, run_clause

pytestmark = [pytest.mark.slow, platforms_group(__name__)]


@pytest.fixture(scope="module")
def broken_platform(pytestconfig: pytest.Config,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; Kueue without waitForPodsReady and a pod network that
    enforces no NetworkPolicy (a flannel-like CNI); taken down at teardown."""
    yield from misconfigured_platform(pytestconfig, tmp_path_factory, "selftest-broken",
                                      {"kueue": {"waitForPodsReady": {"enable": False}},
                                       "network": {"enforceNetworkPolicy": False}})


@pytest.fixture(scope="module")
def unmanaged_platform(pytestconfig: pytest.Config,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; Kueue without the ray.io/rayjob integration (RayJobs bypass
    admission); taken down at teardown."""
    yield from misconfigured_platform(pytestconfig, tmp_path_factory, "selftest-unmanaged",
                                      {"kueue": {"integrations": ["batch/job", "ray.io/raycluster"]}})


@pytest.fixture(scope="module")
def impatient_platform(pytestconfig: pytest.Config,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; Kueue's waitForPodsReady at 20 s, shorter than the 30 s
    image pulls the platform promises are healthy; taken down at teardown."""
    yield from misconfigured_platform(pytestconfig, tmp_path_factory, "selftest-impatient",
                                      {"kueue": {"waitForPodsReady": {"timeout": "20s"}}})


def test_adm3_fails_when_wait_for_pods_ready_is_shorter_than_a_healthy_pull(impatient_platform, tmp_path) -> None:
    name, platform_profile = impatient_platform
    # The profile describes the platform as it is (a 20 s waitForPodsReady) and
    # keeps the default promise that a 30 s pull is healthy.
    row = run_clause(tmp_path, "conformance/admission/test_admission.py::test_late_worker_delays_training_without_splitting_it",
                     profile={"kueue": {"waitForPodsReady": {"timeout": "20s", "backoffBase": "10s"}}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "makes gangs thrash")


def test_net3_fails_and_net1_is_not_applicable_without_policy_enforcement(broken_platform, tmp_path) -> None:
    name, platform_profile = broken_platform
    row = run_clause(tmp_path, "conformance/network/test_network.py::test_network_policy_is_enforced",
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "does not enforce NetworkPolicy")
    row = run_clause(tmp_path / "net1", "conformance/network/test_network.py::test_policy_blocking_collectives_fails_training_fast",
                     platform=name, platform_profile=platform_profile)
    assert row["outcome"] == "not_applicable", f"NET-1 {row['outcome']} where NetworkPolicy is not enforced: {row['message']}"


def test_adm4_fails_when_kueue_has_no_wait_for_pods_ready(broken_platform, tmp_path) -> None:
    name, platform_profile = broken_platform
    # The profile promises a 30 s waitForPodsReady (so the clause gives up after 30 + 60 s);
    # the platform has none.
    row = run_clause(tmp_path, "conformance/admission/test_admission.py::test_gang_that_never_gets_ready_is_evicted_and_requeued",
                     profile={"kueue": {"waitForPodsReady": {"timeout": "30s", "backoffBase": "10s"}}},
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "was not evicted for PodsReadyTimeout")


@pytest.mark.parametrize("clause_test", [
    "test_gang_that_does_not_fit_stays_suspended",  # ADM-1
    "test_teams_sharing_a_queue_get_whole_gangs",  # ADM-2
    "test_late_worker_delays_training_without_splitting_it",  # ADM-3
])
def test_gang_admission_clauses_fail_when_kueue_does_not_manage_rayjobs(unmanaged_platform, tmp_path,
                                                                        clause_test: str) -> None:
    name, platform_profile = unmanaged_platform
    row = run_clause(tmp_path, f"conformance/admission/test_admission.py::{clause_test}",
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, "Kueue does not manage RayJobs")
