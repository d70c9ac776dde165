"""Each Kubernetes clause fails, with a message naming the cause, on a platform that breaks it.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against an embedded
platform started with the matching misconfiguration of its own (Kueue's
waitForPodsReady off or shorter than a healthy image pull, a CNI that does not
enforce NetworkPolicy, Kueue not managing RayJobs), and requires the clause's
outcome to be ``failed`` with a message that names the cause. Each is an
entry of the mutation catalogue (``clusters/embedded/mutations/``). Changes that
need no platform of their own (a golden template, or, until the platform owns
its queues and policies, a profile that describes them) are in
``test_configured_platform_clauses_fail.py``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from clusters.embedded.mutations import entry
from core.catalogue import clause_tests
from core.schema import merged
from tests.selftest.clause_runs import OnePlatformAtATime, expect_failure, platforms_group, run_clause

pytestmark = [pytest.mark.slow, platforms_group(__name__)]

# The catalogue entries these platforms carry. Two entries share one platform
# (Kueue without waitForPodsReady, a CNI that enforces no NetworkPolicy):
# neither clause they judge depends on the other change, and one platform
# less is minutes of CI; `bench mutants` runs each on a platform of its own.
NO_WAIT_FOR_PODS_READY = entry("kueue-without-wait-for-pods-ready")
NO_ENFORCEMENT = entry("cni-enforces-no-networkpolicy")
UNMANAGED = entry("kueue-does-not-manage-rayjobs")
IMPATIENT = entry("wait-for-pods-ready-shorter-than-a-healthy-pull")
TESTS = clause_tests()


@pytest.fixture(scope="module")
def platforms(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnePlatformAtATime]:
    """Module scope; this module's platforms, one up at a time (its tests use each in turn); the last one
    taken down at teardown."""
    one = OnePlatformAtATime(pytestconfig, tmp_path_factory)
    try:
        yield one
    finally:
        one.close()


@pytest.fixture
def broken_platform(platforms: OnePlatformAtATime) -> tuple[str, Path]:
    """Kueue without waitForPodsReady and a pod network that enforces no NetworkPolicy (a flannel-like CNI)."""
    return platforms.get("selftest-broken", merged(NO_WAIT_FOR_PODS_READY.platform_profile(),
                                                   NO_ENFORCEMENT.platform_profile()))


@pytest.fixture
def unmanaged_platform(platforms: OnePlatformAtATime) -> tuple[str, Path]:
    """Kueue without the ray.io/rayjob integration (RayJobs bypass admission)."""
    return platforms.get("selftest-unmanaged", UNMANAGED.platform_profile())


@pytest.fixture
def impatient_platform(platforms: OnePlatformAtATime) -> tuple[str, Path]:
    """Kueue's waitForPodsReady at 20 s, shorter than the 30 s image pulls the platform promises are healthy."""
    return platforms.get("selftest-impatient", IMPATIENT.platform_profile())


def test_adm3_fails_when_wait_for_pods_ready_is_shorter_than_a_healthy_pull(impatient_platform, tmp_path) -> None:
    name, platform_profile = impatient_platform
    # The profile describes the platform as it is (a 20 s waitForPodsReady) and
    # keeps the default promise that a 30 s pull is healthy.
    row = run_clause(tmp_path, TESTS["ADM-3"], profile=IMPATIENT.profile(), platform=name,
                     platform_profile=platform_profile)
    expect_failure(row, *IMPATIENT.expect["ADM-3"])


def test_net3_fails_and_net1_is_not_applicable_without_policy_enforcement(broken_platform, tmp_path) -> None:
    name, platform_profile = broken_platform
    row = run_clause(tmp_path, TESTS["NET-3"], platform=name, platform_profile=platform_profile)
    expect_failure(row, *NO_ENFORCEMENT.expect["NET-3"])
    row = run_clause(tmp_path / "net1", TESTS["NET-1"], platform=name, platform_profile=platform_profile)
    assert row["outcome"] == "not_applicable", f"NET-1 {row['outcome']} where NetworkPolicy is not enforced: {row['message']}"


def test_adm4_fails_when_kueue_has_no_wait_for_pods_ready(broken_platform, tmp_path) -> None:
    name, platform_profile = broken_platform
    # The profile promises a 30 s waitForPodsReady (so the clause gives up after 30 + 60 s);
    # the platform has none.
    row = run_clause(tmp_path, TESTS["ADM-4"], profile=NO_WAIT_FOR_PODS_READY.profile(), platform=name,
                     platform_profile=platform_profile)
    expect_failure(row, *NO_WAIT_FOR_PODS_READY.expect["ADM-4"])


@pytest.mark.parametrize("clause", UNMANAGED.selftest)
def test_gang_admission_clauses_fail_when_kueue_does_not_manage_rayjobs(unmanaged_platform, tmp_path,
                                                                        clause: str) -> None:
    name, platform_profile = unmanaged_platform
    row = run_clause(tmp_path, TESTS[clause], platform=name, platform_profile=platform_profile)
    expect_failure(row, *UNMANAGED.expect[clause])
