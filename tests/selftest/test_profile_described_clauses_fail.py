"""Each Kubernetes clause whose limits come from the profile fails on a platform the profile describes as broken.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against an embedded
platform with the default settings and a certification profile that describes
a misconfigured platform (a 1800 s collective timeout, no GCS fault
tolerance, the dashboard on a NodePort, checkpoints on node-local disks, one
RayCluster shared across teams, ...), and requires the clause's
outcome to be ``failed`` with a message that names the cause. The platform is
one of its own, not the session's, so these runs do not take shares of the
session's platform from the clauses (fixtures/sharing.py).
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


# The platform's golden training environment sets Ray Train's own default
# collective timeout (30 minutes) instead of a tuned one; the clauses measure
# it from the training's process-group setup.
GOLDEN_TIMEOUT_LEFT_AT_30_MINUTES = {"ray": {"env": {"COLLECTIVE_TIMEOUT_S": "1800"}}}

# (clause, the profile that describes the platform as broken, what the failure must name)
CASES = [
    # The platform's golden environment leaves Ray Train's 30-minute collective
    # timeout: the blocked training is still hanging at the promised bound.
    pytest.param("conformance/network/test_network.py::test_policy_blocking_collectives_fails_training_fast",
                 GOLDEN_TIMEOUT_LEFT_AT_30_MINUTES, ("the job hangs instead of failing fast", "timeout of 1800 s"),
                 id="net1-collective-timeout-left-at-30-minutes"),
    # The platform documents a worker policy that admits traffic from the head
    # only: the workers' collectives are dropped, as under NET-1's tightening.
    pytest.param("conformance/network/test_network.py::test_documented_allow_policy_lets_training_run",
                 {"network": {"workerIngress": [{"from": [{"podSelector": {"matchLabels": {"ray.io/node-type": "head"}}}]}]}},
                 ("documented worker policy (the profile's network.workerIngress) ended FAILED",),
                 id="net2-documented-policy-admits-the-head-only"),
    # The same, locked down mid-training on a platform whose policies cut open
    # connections: the blocked all-reduce waits out the 30 minutes.
    pytest.param("conformance/network/test_network.py::test_lockdown_during_training_never_leaves_it_hanging",
                 GOLDEN_TIMEOUT_LEFT_AT_30_MINUTES, ("the job hangs instead of failing fast",),
                 id="net4-collective-timeout-left-at-30-minutes"),
    pytest.param("conformance/training/test_recovery.py::test_worker_preempted_mid_allreduce_resumes_from_checkpoint",
                 GOLDEN_TIMEOUT_LEFT_AT_30_MINUTES, ("ran with a collective timeout of 1800 s",),
                 id="trn1-collective-timeout-left-at-30-minutes"),
    # Checkpoints on each node's own disk: a new cluster after the head's
    # death cannot see them (or Ray Train refuses the storage outright).
    pytest.param("conformance/training/test_recovery.py::test_head_pod_death_retries_and_resumes_from_shared_storage",
                 {"training": {"checkpoints": {"storageClassName": "rayproof-node-local"}}},
                 ("cluster storage", "shared storage"), id="trn2-checkpoints-on-node-local-disks"),
    pytest.param("conformance/operations/test_operations.py::test_ray_dashboard_not_exposed_without_authentication",
                 {"ray": {"headServiceType": "NodePort"}}, ("is type NodePort",),
                 id="sec1-dashboard-on-a-node-port"),
    # The profile says the platform isolates namespaces itself; the embedded one does not.
    pytest.param("conformance/operations/test_operations.py::test_no_ray_node_joins_another_teams_gcs",
                 {"tenancy": {"namespaceIsolation": "platform"}}, ("joined team A's GCS",),
                 id="sec2-namespaces-left-open-to-each-other"),
    # One RayCluster for several teams: the other team's job runs on the hit head.
    pytest.param("conformance/gcs/test_gcs.py::test_head_oom_stays_in_its_namespace",
                 {"tenancy": {"rayClusters": "shared"}}, ("without progress during team A's head OOM",),
                 id="gcs2-one-raycluster-shared-across-teams"),
    pytest.param("conformance/operations/test_operations.py::test_no_ray_node_joins_another_teams_gcs",
                 {"tenancy": {"rayClusters": "shared"}}, ("shares one RayCluster across teams",),
                 id="sec2-one-raycluster-shared-across-teams"),
    pytest.param("conformance/operations/test_operations.py::test_finished_rayjob_cluster_is_torn_down",
                 {"operations": {"ttlSecondsAfterFinished": 600, "teardownWithin": "20s"}},
                 ("stayed held by an idle cluster",), id="ops1-finished-clusters-kept-for-ten-minutes"),
    pytest.param("conformance/admission/test_preemption.py::test_higher_priority_job_preempts_whole_gang_and_victim_resumes",
                 {"kueue": {"preemption": "Never"}}, ("did not preempt",), id="adm5-queues-never-preempt"),
    # Without FT the restarted head has lost the applications: either requests
    # fail past the target, or the applications never come back.
    pytest.param("conformance/gcs/test_gcs.py::test_head_oom_keeps_rayservice_available",
                 {"gcsFaultTolerance": {"enabled": False}}, ("below the target", "apps RUNNING after the head OOM"),
                 id="gcs1-without-gcs-fault-tolerance"),
]


@pytest.mark.parametrize(("clause", "profile", "causes"), CASES)
def test_clause_fails_where_the_profile_describes_the_platform_as_broken(default_platform, tmp_path, clause: str,
                                                                       profile: dict, causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=profile, platform=name, platform_profile=platform_profile)
    expect_failure(row, *causes)
