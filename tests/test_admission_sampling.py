"""The admission sampler judges only what holds resources (conformance/admission/sampling.py)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from conformance.admission.sampling import Sampler, condition_t, gang_violations, holds_resources

CLUSTER_UID, JOB_UID = "uid-raycluster", "uid-submitter-job"


def pod(name: str, owner_uid: str | None, *, phase: str = "Running", deleting: bool = False,
        labels: dict[str, str] | None = None) -> NS:
    owners = [NS(uid=owner_uid, controller=True)] if owner_uid else []
    return NS(metadata=NS(name=name, labels=labels or {}, owner_references=owners, deletion_timestamp="now" if deleting else None,
                          creation_timestamp=None),
              status=NS(phase=phase, conditions=[], container_statuses=[]),
              spec=NS(containers=[]))


def test_a_pod_holds_resources_only_while_it_and_its_controller_stand() -> None:
    live = {CLUSTER_UID}
    assert holds_resources(pod("head", CLUSTER_UID), live)
    assert holds_resources(pod("bare", None), live), "a pod without a controller is judged as it is"
    assert not holds_resources(pod("head", CLUSTER_UID, deleting=True), live)
    assert not holds_resources(pod("head", CLUSTER_UID, phase="Succeeded"), live)
    assert not holds_resources(pod("head", CLUSTER_UID, phase="Failed"), live)
    assert not holds_resources(pod("head", "uid-of-a-deleted-raycluster"), live), (
        "a pod whose RayCluster is gone is being garbage-collected: released, not held")


class FakeLab:
    """Answers the sampler's reads: one namespace, one RayJob whose quota was
    released while its RayCluster's pods and its submitter wait for the
    garbage collector (the moment ADM-2 once failed on)."""

    def __init__(self, owners_alive: bool):
        self.api = None
        self.owners_alive = owners_alive
        gang = {"ray.io/cluster": "job-abcde"}
        self._pods = [pod("job-abcde-head", CLUSTER_UID, labels=gang),
                      pod("job-abcde-w1", CLUSTER_UID, labels=gang), pod("job-abcde-w2", CLUSTER_UID, labels=gang),
                      pod("job-sub", JOB_UID, labels={"job-name": "job"})]
        self.custom = NS(get_cluster_custom_object=lambda *a: {"status": {}},
                         list_namespaced_custom_object=self._list)

    def _list(self, group, version, ns, plural):
        alive = self.owners_alive and plural == "rayclusters"
        return {"items": [{"metadata": {"uid": CLUSTER_UID}}] if alive else []}

    def ray(self, ns, plural, name):
        return {"spec": {"suspend": True}, "status": {"jobDeploymentStatus": "Suspended"}}

    def pods(self, ns):
        return self._pods

    def workloads(self, ns):
        return [{"metadata": {"ownerReferences": [{"kind": "RayJob", "name": "job"}]},
                 "status": {"conditions": [{"type": "QuotaReserved", "status": "False"}]}}]


def sample_with(owners_alive: bool, monkeypatch) -> dict:
    from kubernetes import client

    jobs = [NS(metadata=NS(uid=JOB_UID, deletion_timestamp=None))] if owners_alive else []
    monkeypatch.setattr(client, "BatchV1Api", lambda api: NS(list_namespaced_job=lambda ns: NS(items=jobs)))
    sampler = Sampler(FakeLab(owners_alive), {"job": "ns"}, "cq")
    return sampler.sample()


def test_pods_of_a_released_gang_are_not_held_without_quota(monkeypatch) -> None:
    gangs = {"job": {"pods": 3, "gpus": 0, "podsets": {"head": 1, "workers": 2}}}
    released = sample_with(owners_alive=False, monkeypatch=monkeypatch)
    assert released["jobs"]["job"]["pods"] == 0 and released["jobs"]["job"]["submitter"] == 0
    assert released["jobs"]["job"]["releasing"] == 3
    assert gang_violations([released], gangs, quota_gpus=0) == []
    # The same pods with their RayCluster and Job standing are a gang held without quota.
    held = sample_with(owners_alive=True, monkeypatch=monkeypatch)
    assert held["jobs"]["job"]["pods"] == 3 and held["jobs"]["job"]["submitter"] == 1
    assert gang_violations([held], gangs, quota_gpus=0) == [
        "t=0.0s job: 3 gang pods and 1 submitter without quota reserved"]


class EvictedBetweenReads(FakeLab):
    """Kueue evicts the RayJob while the sampler reads: the RayJob is still
    unsuspended when first read, the Workload read next has its quota
    released, and a RayJob read after it is suspended (ADM-2 once failed on
    this moment, at the 240 s waitForPodsReady timeout, on real nodes)."""

    def __init__(self, evicted: bool):
        super().__init__(owners_alive=False)
        self.evicted, self.reads = evicted, 0

    def ray(self, ns, plural, name):
        self.reads += 1
        suspended = self.evicted and self.reads > 1
        return {"spec": {"suspend": suspended}, "status": {"jobDeploymentStatus": "Running"}}


@pytest.mark.parametrize("evicted", [True, False])
def test_an_eviction_between_two_reads_is_not_a_job_running_without_quota(monkeypatch, evicted: bool) -> None:
    from kubernetes import client

    monkeypatch.setattr(client, "BatchV1Api", lambda api: NS(list_namespaced_job=lambda ns: NS(items=[])))
    gangs = {"job": {"pods": 3, "gpus": 0, "podsets": {"head": 1, "workers": 2}}}
    sample = Sampler(EvictedBetweenReads(evicted), {"job": "ns"}, "cq").sample()
    assert sample["jobs"]["job"]["suspend"] is evicted
    # Unsuspended at both reads, with no quota between them, is what the clause must catch.
    assert gang_violations([sample], gangs, quota_gpus=0) == (
        [] if evicted else ["t=0.0s job: RayJob not suspended without quota reserved"])


def _sample(t: float, wall: float, **conditions: str) -> dict:
    return {"t": t, "wall": wall, "cq": {},
            "jobs": {"stuck": {"conditions": {kind: {"status": "True", "reason": "R", "at": at}
                                              for kind, at in conditions.items()}}}}


def test_condition_times_are_placed_on_the_samplers_monotonic_clock() -> None:
    """ADM-4 once failed at "pods gone after 300.2 s" on a machine whose wall clock
    moved 57 s against its monotonic clock mid-clause: the pods had gone 242 s
    after admission. Conditions are placed by the sample that first showed them."""
    wall0 = 1_796_306_000.0  # 2026-12-03T13:53:20Z
    samples = [_sample(0.0, wall0),
               _sample(1.0, wall0 + 1.0, Admitted="2026-12-03T13:53:21Z"),
               _sample(120.0, wall0 + 120.0, Admitted="2026-12-03T13:53:21Z"),
               # the wall clock steps 57 s forward here; Kueue evicts at 240 s
               _sample(241.0, wall0 + 298.0, Admitted="2026-12-03T13:53:21Z", Evicted="2026-12-03T13:58:17Z")]
    assert condition_t(samples, "stuck", "Admitted") == 1.0
    assert condition_t(samples, "stuck", "Evicted") == 240.0
    assert condition_t(samples, "stuck", "Requeued") is None
    assert condition_t(samples, "other", "Admitted") is None


def test_a_condition_is_never_placed_before_the_sample_that_did_not_show_it() -> None:
    """An API server whose clock runs ahead of the runner's (or lastTransitionTime's
    whole seconds) moves a time by at most one sample interval."""
    wall0 = 1_796_306_000.0
    samples = [_sample(10.0, wall0), _sample(11.0, wall0 + 1.0, Admitted="2026-12-03T13:50:00Z")]
    assert condition_t(samples, "stuck", "Admitted") == 10.0
    # the first sample already shows it: placed by its own wall clock, however long ago
    assert condition_t(samples[1:], "stuck", "Admitted") == 11.0 - (wall0 + 1.0 - 1_796_305_800.0)
