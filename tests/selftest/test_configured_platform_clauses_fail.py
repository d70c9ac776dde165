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
ten minutes. Others change an onboarding class of the platform
(``clusters/embedded/onboarding/``), installed beside the reference one as
its operators would and named by the profile's ``teams.namespaceLabels``:
ClusterQueues that never preempt, a worker policy that admits the head
only, team namespaces whose heads are left open. One points the profile at
another of the platform's storage classes, a node-local one.

None of these changes needs a platform of its own, yet they run on one (with
the default settings): SEC-1, which judges every Service of the cluster, would
see on the session's platform the NodePort its self-test exposes on purpose.
Each lane holds one of the machine's host slots while it uses the platform,
and its nested runs inherit it (fixtures/sharing.py): beside the clauses on the session's platform on
two cores they once made it slow enough that Kueue evicted the gangs of
other clauses by waitForPodsReady (measured: TRN-1's gang evicted four times
in ten minutes, its head's container started 74 s after it was scheduled).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from rayproof import timeouts
from rayproof.profile import cluster_spec_in
from tests.selftest.clause_runs import expect_failure, misconfigured_platform, platforms_group, run_clause

pytestmark = pytest.mark.slow
# Three lanes (xdist groups) of nested runs on the one platform these share
# (each lane's worker joins it; the last to leave takes it down): one lane
# alone was the run's longest (eleven nested runs, 55 minutes on two cores).
TIMEOUT_LANE, TEMPLATE_LANE, ONBOARDING_LANE = (platforms_group(f"{__name__}-{lane}")
                                                 for lane in ("collective-timeout", "templates", "onboarding"))

GOLDEN = Path(__file__).resolve().parents[2] / "clusters" / "embedded" / "golden"
TEMPLATE_FILES = {"rayJob": "rayjob.yaml", "rayCluster": "raycluster.yaml", "rayService": "rayservice.yaml"}


@pytest.fixture(scope="module")
def default_platform(pytestconfig: pytest.Config,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Module scope; an embedded platform with the default settings, shared by
    the workers of this module's lanes; taken down by the last to leave it."""
    yield from misconfigured_platform(pytestconfig, tmp_path_factory, "selftest-default", {})


def _ray_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = cluster_spec_in(obj)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [g["template"]["spec"]["containers"][0] for g in groups]


def without_tuned_collective_timeout(job: dict[str, Any]) -> None:
    """The golden image leaves Ray Train's default collective timeout (30 minutes)."""
    for container in _ray_containers(job):
        container["env"] = [e for e in container["env"] if e["name"] != "COLLECTIVE_TIMEOUT_S"]


def without_gcs_fault_tolerance(obj: dict[str, Any]) -> None:
    """The golden RayService or RayCluster keeps its GCS state in the head only."""
    cluster_spec_in(obj).pop("gcsFaultToleranceOptions")


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
                 id="net1-collective-timeout-left-at-ray-trains-default", marks=TIMEOUT_LANE),
    # Locked down mid-training on a platform whose policies cut open
    # connections: the blocked all-reduce waits out the 30 minutes.
    pytest.param(f"{NET}::test_lockdown_during_training_never_leaves_it_hanging",
                 "rayJob", without_tuned_collective_timeout, ("the job hangs instead of failing fast",),
                 id="net4-collective-timeout-left-at-ray-trains-default", marks=TIMEOUT_LANE),
    pytest.param(f"{TRN}::test_worker_preempted_mid_allreduce_resumes_from_checkpoint",
                 "rayJob", without_tuned_collective_timeout, ("ran with a collective timeout of 1800 s",),
                 id="trn1-collective-timeout-left-at-ray-trains-default", marks=TIMEOUT_LANE),
    pytest.param(f"{OPS}::test_ray_dashboard_not_exposed_without_authentication",
                 "rayCluster", head_on_a_node_port, ("reachable from outside the cluster",),
                 id="sec1-head-service-on-a-node-port", marks=TEMPLATE_LANE),
    pytest.param(f"{OPS}::test_finished_rayjob_cluster_is_torn_down",
                 "rayJob", finished_clusters_kept_ten_minutes, ("stayed held by an idle cluster",),
                 id="ops1-finished-clusters-kept-for-ten-minutes", marks=TEMPLATE_LANE),
    # Without FT the restarted head has lost the applications: either requests
    # fail past the target, or the applications never come back.
    pytest.param(f"{GCS}::test_head_oom_keeps_rayservice_available",
                 "rayService", without_gcs_fault_tolerance, ("below the target", "apps RUNNING after the head OOM"),
                 id="gcs1-rayservice-without-gcs-fault-tolerance", marks=TEMPLATE_LANE),
    # Team A's golden RayCluster without GCS fault tolerance: the restarted
    # head has forgotten the job whose driver it ran, and KubeRay keeps
    # showing that RayJob Running (kuberay#2161).
    pytest.param(f"{GCS}::test_head_oom_stays_in_its_namespace",
                 "rayCluster", without_gcs_fault_tolerance, ("neither terminal nor retrying",),
                 id="gcs2-raycluster-without-gcs-fault-tolerance", marks=TEMPLATE_LANE),
]


# Waits a broken platform is known to wait out in full. Without GCS FT team A's
# RayJob shows Running for good (kuberay#2161): 120 s of that says as much as
# the default 300 s, and GCS-2 holds two host slots while it waits.
SHORTER_WAITS = {f"{GCS}::test_head_oom_stays_in_its_namespace": {timeouts.HEAD_LOSS_SETTLE: 120}}


@pytest.mark.parametrize(("clause", "template", "change", "causes"), TEMPLATE_MUTATIONS)
def test_clause_fails_on_a_changed_golden_template(default_platform, tmp_path, clause: str, template: str,
                                                   change: Callable[[dict[str, Any]], None],
                                                   causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=mutated_template(tmp_path / "golden", template, change),
                     platform=name, platform_profile=platform_profile, bounds=SHORTER_WAITS.get(clause))
    expect_failure(row, *causes)


def _objects(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert found, f"the reference onboarding class has no {kind} {name or ''}"
    return found


def queues_never_preempt(docs: list[dict[str, Any]]) -> None:
    """The tenants' ClusterQueues never preempt within themselves."""
    for cq in _objects(docs, "ClusterQueue"):
        cq["spec"]["preemption"]["withinClusterQueue"] = "Never"


def worker_policy_admits_the_head_only(docs: list[dict[str, Any]]) -> None:
    """The documented worker policy admits traffic from the head only: the
    workers' collectives are dropped, as under NET-1's tightening."""
    for policy in _objects(docs, "NetworkPolicy", "ray-workers"):
        policy["spec"]["ingress"] = [{"from": [{"podSelector": {"matchLabels": {"ray.io/node-type": "head"}}}]}]


def without_head_isolation(docs: list[dict[str, Any]]) -> None:
    """Team namespaces get no policy guarding their Ray heads from other namespaces."""
    _objects(docs, "NetworkPolicy", "ray-head-isolation")
    docs[:] = [d for d in docs if d["metadata"]["name"] != "ray-head-isolation"]


@pytest.fixture
def onboarding_class(default_platform, request) -> Iterator[Callable[[Callable[[list[dict[str, Any]]], None]], dict]]:
    """Installs, as the platform's operators would, an onboarding class that
    is the reference ``standard`` one with one change, and returns the
    profile pointing teams at it; removed at the end."""
    from kubernetes import client

    from clusters.embedded.onboarding.controller import (CLASS_LABEL, CLASSES_NAMESPACE, ONBOARDING_DIR, Onboarding,
                                                          class_configmap_name)
    from clusters.embedded.platform import EmbeddedPlatform

    name, _ = default_platform
    api = EmbeddedPlatform(name).api_client()
    installed: list[str] = []

    def install(change: Callable[[list[dict[str, Any]]], None]) -> dict:
        docs = list(yaml.safe_load_all((ONBOARDING_DIR / "standard.yaml").read_text()))
        change(docs)
        cls = f"selftest-{change.__name__.replace('_', '-')}"[:50]
        Onboarding(api).install_classes({cls: yaml.safe_dump_all(docs, sort_keys=False)})
        installed.append(cls)
        return {"teams": {"namespaceLabels": {CLASS_LABEL: cls}}}

    yield install
    for cls in installed:
        client.CoreV1Api(api).delete_namespaced_config_map(class_configmap_name(cls), CLASSES_NAMESPACE)


ADM = "conformance/admission/test_preemption.py"

# (clause, the one change to the reference platform's onboarding, what the failure must name)
ONBOARDING_MUTATIONS = [
    pytest.param(f"{ADM}::test_higher_priority_job_preempts_whole_gang_and_victim_resumes",
                 queues_never_preempt, ("did not preempt",), id="adm5-queues-never-preempt", marks=ONBOARDING_LANE),
    pytest.param(f"{NET}::test_platform_worker_policy_lets_training_run",
                 worker_policy_admits_the_head_only, ("training under the platform's worker policies (ray-workers) ended FAILED",),
                 id="net2-worker-policy-admits-the-head-only", marks=ONBOARDING_LANE),
    pytest.param(f"{OPS}::test_no_ray_node_joins_another_teams_gcs",
                 without_head_isolation, ("joined team A's GCS",), id="sec2-heads-left-open-to-other-namespaces", marks=ONBOARDING_LANE),
]


@pytest.mark.parametrize(("clause", "change", "causes"), ONBOARDING_MUTATIONS)
def test_clause_fails_on_a_changed_onboarding(default_platform, onboarding_class, tmp_path, clause: str,
                                              change: Callable[[list[dict[str, Any]]], None],
                                              causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=onboarding_class(change), platform=name,
                     platform_profile=platform_profile)
    expect_failure(row, *causes)


# (clause, the platform object the profile points at, what the failure must name)
POINTER_MUTATIONS = [
    # Checkpoints on each node's own disk (the platform's node-local storage
    # class): a new cluster after the head's death cannot see them (or Ray
    # Train refuses the storage outright).
    pytest.param(f"{TRN}::test_head_pod_death_retries_and_resumes_from_shared_storage",
                 {"training": {"checkpoints": {"storageClassName": "rayproof-node-local"}}},
                 ("cluster storage", "shared storage"), id="trn2-checkpoints-on-node-local-disks", marks=ONBOARDING_LANE),
]


@pytest.mark.parametrize(("clause", "profile", "causes"), POINTER_MUTATIONS)
def test_clause_fails_where_the_profile_points_at_a_broken_platform_object(default_platform, tmp_path, clause: str,
                                                                          profile: dict, causes: tuple[str, ...]) -> None:
    name, platform_profile = default_platform
    row = run_clause(tmp_path, clause, profile=profile, platform=name, platform_profile=platform_profile)
    expect_failure(row, *causes)
