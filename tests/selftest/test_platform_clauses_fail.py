"""Each Kubernetes clause fails, with a message naming the cause, on a platform that breaks it.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against either

* the default embedded platform with a certification profile that describes a
  misconfigured platform (a 1800 s collective timeout, no GCS fault
  tolerance, the dashboard on a NodePort, ...), or
* an embedded platform started with the matching misconfiguration of its own
  (Kueue's waitForPodsReady off, a CNI that does not enforce NetworkPolicy,
  Kueue not managing RayJobs),

and requires the clause's outcome to be ``failed`` with a message that names
the cause.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from clusters.embedded.target import EmbeddedTarget
from fixtures.timeouts import Tier

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# One clause run, platform start included, on two cores.
CLAUSE_RUN = Tier("selftest_clause_run", 1200, "one clause run in a subprocess")


def run_clause(tmp_path: Path, test: str, *, profile: dict | None = None, platform: str | None = None,
               platform_profile: Path | None = None) -> dict[str, Any]:
    """Run one clause (``path::test``) as certify does; return its result row."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    results = tmp_path / "results.json"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
            "--rootdir", str(REPO), str(REPO / test), "-q", f"--rayproof-results={results}"]
    if profile is not None:
        path = tmp_path / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        argv += ["--profile", str(path)]
    if platform is not None:
        argv += ["--platform-name", platform]
    if platform_profile is not None:
        argv += ["--platform-profile", str(platform_profile)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=CLAUSE_RUN.seconds)
    assert results.exists(), f"the clause run wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    rows = [r for r in json.loads(results.read_text())["results"] if r["nodeid"].endswith(test.split("::")[-1])]
    assert rows, f"no result for {test}:\n{proc.stdout[-3000:]}"
    return rows[-1]


def expect_failure(row: dict[str, Any], *causes: str) -> None:
    """The clause failed, and its message names one of ``causes``."""
    assert row["outcome"] == "failed", f"{row['clause']} {row['outcome']} on a platform that breaks it: {row['message'][:500]}"
    assert any(c.lower() in row["message"].lower() for c in causes), (
        f"{row['clause']} failed, but its message does not name the cause ({causes}): {row['message'][:800]}")


@pytest.fixture(scope="module")
def default_platform(target) -> Any:
    """Module scope; the session's platform (the clause subprocesses reuse it; nothing to clean up here)."""
    return target


def misconfigured_platform(tmp_path_factory: pytest.TempPathFactory, name: str, profile: dict) -> Iterator[tuple[str, Path]]:
    """An embedded platform started with ``profile`` over the defaults; taken down at the end."""
    path = tmp_path_factory.mktemp(name) / "platform-profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    target = EmbeddedTarget.start(name=name, profile=path, progress=print)
    try:
        yield name, path
    finally:
        target.platform.down()


@pytest.fixture(scope="module")
def broken_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; Kueue without waitForPodsReady and a pod network that
    enforces no NetworkPolicy (a flannel-like CNI); taken down at teardown."""
    yield from misconfigured_platform(tmp_path_factory, "selftest-broken",
                                      {"kueue": {"waitForPodsReady": {"enable": False}},
                                       "network": {"enforceNetworkPolicy": False}})


@pytest.fixture(scope="module")
def unmanaged_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; Kueue without the ray.io/rayjob integration (RayJobs bypass
    admission); taken down at teardown."""
    yield from misconfigured_platform(tmp_path_factory, "selftest-unmanaged",
                                      {"kueue": {"integrations": ["batch/job", "ray.io/raycluster"]}})


# -- described by the profile, on the default platform ----------------------------------


def test_net1_fails_when_the_collective_timeout_is_left_at_30_minutes(default_platform, tmp_path) -> None:
    row = run_clause(tmp_path, "conformance/network/test_network.py::test_policy_blocking_collectives_fails_training_fast",
                     profile={"training": {"collectiveTimeout": "1800s"}})
    expect_failure(row, "above the fail-fast bound")


def test_trn1_fails_when_the_collective_timeout_is_left_at_30_minutes(default_platform, tmp_path) -> None:
    row = run_clause(tmp_path, "conformance/training/test_recovery.py::"
                               "test_worker_preempted_mid_allreduce_resumes_from_checkpoint",
                     profile={"training": {"collectiveTimeout": "1800s"}})
    expect_failure(row, "above the fail-fast bound")


def test_sec1_fails_when_the_dashboard_is_on_a_node_port(default_platform, tmp_path) -> None:
    row = run_clause(tmp_path, "conformance/operations/test_operations.py::test_ray_dashboard_not_exposed_without_authentication",
                     profile={"ray": {"headServiceType": "NodePort"}})
    expect_failure(row, "is type NodePort")


def test_sec2_fails_when_namespaces_are_left_open_to_each_other(default_platform, tmp_path) -> None:
    # The profile says the platform isolates namespaces itself; the embedded one does not.
    row = run_clause(tmp_path, "conformance/operations/test_operations.py::test_no_ray_node_joins_another_teams_gcs",
                     profile={"tenancy": {"namespaceIsolation": "platform"}})
    expect_failure(row, "joined team A's GCS")


def test_ops1_fails_when_finished_clusters_are_kept_for_ten_minutes(default_platform, tmp_path) -> None:
    row = run_clause(tmp_path, "conformance/operations/test_operations.py::test_finished_rayjob_cluster_is_torn_down",
                     profile={"operations": {"ttlSecondsAfterFinished": 600, "teardownWithin": "20s"}})
    expect_failure(row, "stayed held by an idle cluster")


def test_adm5_fails_when_queues_never_preempt(default_platform, tmp_path) -> None:
    row = run_clause(tmp_path, "conformance/admission/test_preemption.py::"
                               "test_higher_priority_job_preempts_whole_gang_and_victim_resumes",
                     profile={"kueue": {"preemption": "Never"}})
    expect_failure(row, "did not preempt")


def test_gcs1_fails_without_gcs_fault_tolerance(default_platform, tmp_path) -> None:
    row = run_clause(tmp_path, "conformance/gcs/test_gcs.py::test_head_oom_keeps_rayservice_available",
                     profile={"gcsFaultTolerance": {"enabled": False}})
    # Without FT the restarted head has lost the applications: either requests
    # fail past the target, or the applications never come back.
    expect_failure(row, "below the target", "apps RUNNING after the head OOM")


# -- misconfigured platforms ------------------------------------------------------------


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
