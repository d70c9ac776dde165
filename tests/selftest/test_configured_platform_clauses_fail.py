"""Each Kubernetes clause fails, for its stated cause, on the reference platform with one configuration change.

A suite that cannot fail proves nothing. Each case runs the real clause (a
pytest subprocess, exactly as `rayproof certify` runs it) against an embedded
platform with the default settings and requires the clause's outcome to be
``failed`` with a message that names the cause.

The change is one a platform team makes. Most are a change to one of the
platform's golden templates (``clusters/embedded/golden/``), which the
profile points at exactly as a platform points it at its own: a golden image
that leaves Ray Train's 30-minute collective timeout, a RayService without
GCS fault tolerance, a head Service on a NodePort, finished clusters kept for
ten minutes; or the storage class checkpoints go to. The rest
(``PROFILE_DESCRIBED``) still describe a platform setting in the profile,
because the suite itself still provisions those queues and policies as the
profile says (issue 12: until the platform's own onboarding provides them).

None of these changes needs a platform of its own, yet they run on one (with
the default settings), in the one xdist worker that runs the self-tests on
platforms of their own: run beside the clauses on the session's platform, on
two cores, they made it slow enough that Kueue evicted the gangs of other
clauses by waitForPodsReady (measured: TRN-1's gang evicted four times in ten
minutes, its head's container started 74 s after it was scheduled), and SEC-1,
which judges every Service of the cluster, would see the NodePort its
self-test exposes on purpose.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from rayproof.profile import cluster_spec_in
from tests.selftest.clause_runs import PLATFORMS_GROUP, expect_failure, misconfigured_platform, run_clause

pytestmark = [pytest.mark.slow, PLATFORMS_GROUP]

GOLDEN = Path(__file__).resolve().parents[2] / "clusters" / "embedded" / "golden"
TEMPLATE_FILES = {"rayJob": "rayjob.yaml", "rayCluster": "raycluster.yaml", "rayService": "rayservice.yaml"}


@pytest.fixture(scope="module")
def default_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; an embedded platform with the default settings; taken down at teardown."""
    yield from misconfigured_platform(tmp_path_factory, "selftest-default", {})


def _ray_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = cluster_spec_in(obj)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [g["template"]["spec"]["containers"][0] for g in groups]


def without_tuned_collective_timeout(job: dict[str, Any]) -> None:
    """The golden image leaves Ray Train's default collective timeout (30 minutes)."""
    for container in _ray_containers(job):
        container["env"] = [e for e in container["env"] if e["name"] != "COLLECTIVE_TIMEOUT_S"]


def without_gcs_fault_tolerance(service: dict[str, Any]) -> None:
    cluster_spec_in(service).pop("gcsFaultToleranceOptions")


def head_on_a_node_port(cluster: dict[str, Any]) -> None:
    cluster_spec_in(cluster)["headGroupSpec"]["serviceType"] = "NodePort"


def finished_clusters_kept_ten_minutes(job: dict[str, Any]) -> None:
    job["spec"]["ttlSecondsAfterFinished"] = 600


def mutated_template(directory: Path, template: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A profile pointing ``template`` at a copy of the reference platform's with ``change`` made."""
    obj = yaml.safe_load((GOLDEN / TEMPLATE_FILES[template]).read_text())
    change(obj)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"mutated-{TEMPLATE_FILES[template]}"
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return {"templates": {template: str(path)}}


NET, TRN, GCS, OPS = (f"conformance/{d}" for d in ("network/test_network.py", "training/test_recovery.py",
                                                   "gcs/test_gcs.py", "operations/test_operations.py"))

# (clause, the golden template and its one change, what the failure must name)
TEMPLATE_MUTATIONS = [
    pytest.param(f"{NET}::test_policy_blocking_collectives_fails_training_fast",
                 "rayJob", without_tuned_collective_timeout,
                 ("the job hangs instead of failing fast", "timeout of 1800 s"),
                 id="net1-collective-timeout-left-at-ray-trains-default"),
    # Locked down mid-training on a platform whose policies cut open
    # connections: the blocked all-reduce waits out the 30 minutes.
    pytest.param(f"{NET}::test_lockdown_during_training_never_leaves_it_hanging",
                 "rayJob", without_tuned_collective_timeout, ("the job hangs instead of failing fast",),
                 id="net4-collective-timeout-left-at-ray-trains-default"),
    pytest.param(f"{TRN}::test_worker_preempted_mid_allreduce_resumes_from_checkpoint",
                 "rayJob", without_tuned_collective_timeout, ("ran with a collective timeout of 1800 s",),
                 id="trn1-collective-timeout-left-at-ray-trains-default"),
    pytest.param(f"{OPS}::test_ray_dashboard_not_exposed_without_authentication",
                 "rayCluster", head_on_a_node_port, ("reachable from outside the cluster",),
                 id="sec1-head-service-on-a-node-port"),
    pytest.param(f"{OPS}::test_finished_rayjob_cluster_is_torn_down",
                 "rayJob", finished_clusters_kept_ten_minutes, ("stayed held by an idle cluster",),
                 id="ops1-finished-clusters-kept-for-ten-minutes"),
    # Without FT the restarted head has lost the applications: either requests
    # fail past the target, or the applications never come back.
    pytest.param(f"{GCS}::test_head_oom_keeps_rayservice_available",
                 "rayService", without_gcs_fault_tolerance, ("below the target", "apps RUNNING after the head OOM"),
                 id="gcs1-rayservice-without-gcs-fault-tolerance"),
]


@pytest.mark.parametrize(("clause", "template", "change", "causes"), TEMPLATE_MUTATIONS)
def test_clause_fails_on_a_changed_golden_template(default_platform, tmp_path, clause: str, template: str,
                                                   change: Callable[[dict[str, Any]], None],
                                                   causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=mutated_template(tmp_path / "golden", template, change),
                     platform=name, platform_profile=platform_profile)
    expect_failure(row, *causes)


# (clause, the profile's pointer or description of the platform, what the failure must name)
PROFILE_DESCRIBED = [
    # Checkpoints on each node's own disk (the platform's node-local storage
    # class): a new cluster after the head's death cannot see them (or Ray
    # Train refuses the storage outright).
    pytest.param(f"{TRN}::test_head_pod_death_retries_and_resumes_from_shared_storage",
                 {"training": {"checkpoints": {"storageClassName": "rayproof-node-local"}}},
                 ("cluster storage", "shared storage"), id="trn2-checkpoints-on-node-local-disks"),
    # The platform documents a worker policy that admits traffic from the head
    # only: the workers' collectives are dropped, as under NET-1's tightening.
    pytest.param(f"{NET}::test_documented_allow_policy_lets_training_run",
                 {"network": {"workerIngress": [{"from": [{"podSelector": {"matchLabels": {"ray.io/node-type": "head"}}}]}]}},
                 ("documented worker policy (the profile's network.workerIngress) ended FAILED",),
                 id="net2-documented-policy-admits-the-head-only"),
    # The profile says the platform isolates namespaces itself; the embedded one does not.
    pytest.param(f"{OPS}::test_no_ray_node_joins_another_teams_gcs",
                 {"tenancy": {"namespaceIsolation": "platform"}}, ("joined team A's GCS",),
                 id="sec2-namespaces-left-open-to-each-other"),
    # One RayCluster for several teams: the other team's job runs on the hit head.
    pytest.param(f"{GCS}::test_head_oom_stays_in_its_namespace",
                 {"tenancy": {"rayClusters": "shared"}}, ("without progress during team A's head OOM",),
                 id="gcs2-one-raycluster-shared-across-teams"),
    pytest.param(f"{OPS}::test_no_ray_node_joins_another_teams_gcs",
                 {"tenancy": {"rayClusters": "shared"}}, ("shares one RayCluster across teams",),
                 id="sec2-one-raycluster-shared-across-teams"),
    pytest.param("conformance/admission/test_preemption.py::test_higher_priority_job_preempts_whole_gang_and_victim_resumes",
                 {"kueue": {"preemption": "Never"}}, ("did not preempt",), id="adm5-queues-never-preempt"),
]


@pytest.mark.parametrize(("clause", "profile", "causes"), PROFILE_DESCRIBED)
def test_clause_fails_where_the_profile_describes_the_platform_as_broken(default_platform, tmp_path, clause: str,
                                                                       profile: dict, causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=profile, platform=name, platform_profile=platform_profile)
    expect_failure(row, *causes)
