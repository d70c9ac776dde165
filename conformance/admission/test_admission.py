"""Kueue admission of Ray gangs: all or nothing (ADM-1, ADM-2), and what happens
to a gang one of whose workers is late (ADM-3) or never comes (ADM-4)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from chaos import runner, straggler
from chaos.straggler import EVICTED_AT_PODS_READY_TIMEOUT
from conformance.admission.sampling import FINISHED, Sampler, compact, condition_at, condition_t, epoch, gang_of, gang_violations
from conformance.training_jobs import gang_gpus, training_rayjob
from core import kueue, timeouts
from core.cost import record_idle_cost
from core.figures import BOUND_S, FIGURES, GANG_PER_SECOND, EvictionFigures
from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for
from fixtures import manifests as mf
from fixtures.events import parse_events

pytestmark = pytest.mark.slow

HOLD_S = 40  # ADM-1: how long the first job holds its gang
SHORT_HOLD_S = 15  # the other jobs' run time
# ADM-2: three gangs through a queue of two. On a loaded machine a gang whose
# pods wait for node CPU still held by the previous gang's terminating pods
# can be evicted by waitForPodsReady and requeued (measured in CI: team C  # platform-owned-ok: Kueue's, observed
# evicted once, readmitted 10 min after submission), so each of the two
# admission rounds gets a training run's budget.
THREE_TEAMS_RUN = Tier("three_teams_run", 2 * timeouts.TRAINING_RUN.seconds,
                       "three teams' RayJobs through a ClusterQueue sized for two gangs")


def hold_job(lab: Any, namespace: str, name: str, seconds: float) -> dict[str, Any]:
    """The golden RayJob (head + 2 workers) holding its gang for ``seconds``, queued to the team's LocalQueue."""
    return lab.rayjob(namespace, name, mf.hold_entrypoint(seconds), queue=lab.queue)


def finished(sample: dict[str, Any], names: list[str]) -> bool:
    return all(n in sample["jobs"] and sample["jobs"][n]["deploy"] in FINISHED for n in names)


def holds(job: dict[str, Any]) -> bool:
    """The job holds quota (admitted, not finished, not yet given back)."""
    return bool(job["quota"] and not job["finished"] and job["deploy"] not in FINISHED)


@pytest.mark.clause("ADM-1")
def test_gang_that_does_not_fit_stays_suspended(lab, evidence) -> None:
    """A RayJob whose gang does not fit its ClusterQueue MUST stay suspended, with
    none of its pods (gang or submitter) created, until the whole gang fits; then
    it MUST be admitted and succeed. Checked with a ClusterQueue of one gang's
    GPUs: job B, submitted while job A holds the gang, is sampled every second
    until A gives the gang back (finishes, or is evicted and requeued)."""
    gang = gang_gpus(lab)
    ns = lab.namespace("a", gpus=gang)
    a, b = lab.name("hold"), lab.name("wait")
    sampler = Sampler(lab, {a: ns}, lab.cluster_queue)
    evidence.record("queue_gpus", lab.cluster_queue_gpus())
    with evidence.phase("A admitted"):
        body_a = lab.create_ray(ns, "rayjobs", hold_job(lab, ns, a, HOLD_S))
        wait_for(sampler.sample, lambda s: a in s["jobs"] and s["jobs"][a]["quota"],
                 timeout=timeouts.CONTROLLER_RECONCILE, interval=1, description=f"RayJob {a} to be admitted")
    with evidence.phase("B waits while A holds the gang"):
        body_b = lab.create_ray(ns, "rayjobs", hold_job(lab, ns, b, SHORT_HOLD_S))
        sampler.jobs[b] = ns
        wait_for(sampler.sample, lambda s: b in s["jobs"] and s["jobs"][b]["quota"], timeout=timeouts.TRAINING_RUN,
                 interval=1, description=f"RayJob {b} to be admitted once {a} gives its gang back")
    with evidence.phase("both finish"):
        wait_for(sampler.sample, lambda s: finished(s, [a, b]), timeout=timeouts.TRAINING_RUN, interval=1,
                 description=f"RayJobs {a} and {b} to finish")
    samples = sampler.samples
    evidence.record("samples", compact(samples))
    gangs = {a: gang_of(body_a), b: gang_of(body_b)}
    with_b = [s for s in samples if b in s["jobs"]]
    b_admitted = next(s for s in with_b if s["jobs"][b]["quota"])
    while_a = [s["jobs"][b] for s in with_b if holds(s["jobs"][a]) and s["t"] <= b_admitted["t"]]
    a_last_held = max((s["t"] for s in with_b if holds(s["jobs"][a]) and s["t"] < b_admitted["t"]), default=None)
    final = samples[-1]["jobs"]
    a_released_by = {c: condition_at(samples, a, c) for c in ("Evicted", "Finished")}
    evidence.record("b_samples_while_a_held", len(while_a))
    evidence.record("b_while_a_held", {"max_pods": max((j["pods"] + j["submitter"] for j in while_a), default=None),
                                       "always_suspended": all(j["suspend"] for j in while_a),
                                       "ever_quota": any(j["quota"] for j in while_a)})
    evidence.record("a_held_until_s", a_last_held)
    evidence.record("b_admitted_at_s", b_admitted["t"])
    evidence.record("a_gave_gang_back_by", {k: v and datetime.fromtimestamp(v).isoformat() for k, v in
                                            a_released_by.items()})
    evidence.record("a_requeues", max(int((s["jobs"][a]["requeue"] or {}).get("count") or 0) for s in samples))
    evidence.record("outcome", {n: {"jobStatus": final[n]["job"], "deploy": final[n]["deploy"]} for n in (a, b)})
    assert len(while_a) >= 10, f"only {len(while_a)} samples of {b} while {a} held the gang (expected >= 10)"
    holding = [j for j in while_a if j["pods"] or j["submitter"] or j["releasing"] or not j["suspend"] or j["quota"]]
    assert not holding, (
        f"{b} was not fully suspended while {a} held the queue's only gang: expected suspend=true, no quota, no pods; "
        f"saw {holding[:3]}")
    assert a_last_held is not None and a_last_held < b_admitted["t"], (
        f"{b} was admitted at t={b_admitted['t']}s, expected after {a} gave the gang back (last held t={a_last_held}s)")
    violations = gang_violations(samples, gangs, gang)
    assert not violations, f"partial gangs held: {violations[:5]}"
    for n in (a, b):
        assert final[n]["job"] == "SUCCEEDED", f"RayJob {n} ended {final[n]['job']} ({final[n]['deploy']}), expected SUCCEEDED"


@pytest.mark.clause("ADM-2")
@pytest.mark.cluster_gangs(2)  # its ClusterQueue holds two gangs
def test_teams_sharing_a_queue_get_whole_gangs(lab, evidence) -> None:
    """When three teams (three namespaces, each with its own LocalQueue on one
    ClusterQueue sized for two gangs) submit RayJobs at once that together exceed
    it, at every sampled moment each admitted job MUST have quota for its whole
    gang and all its pods once running, no job MUST hold pods or quota for part
    of a gang, no more than two gangs MUST hold the queue, and all three jobs
    MUST eventually succeed."""
    teams = ["a", "b", "c"]
    gang = gang_gpus(lab)
    namespaces = [lab.namespace(t, gpus=2 * gang) for t in teams]
    jobs = {lab.name(f"team{t}"): ns for t, ns in zip(teams, namespaces)}
    sampler = Sampler(lab, jobs, lab.cluster_queue)
    evidence.record("queue_gpus", lab.cluster_queue_gpus())
    with evidence.phase("submit"):
        bodies = {n: lab.create_ray(ns, "rayjobs", hold_job(lab, ns, n, SHORT_HOLD_S)) for n, ns in jobs.items()}
    gangs = {n: gang_of(b) for n, b in bodies.items()}
    with evidence.phase("run"):
        # Ends at the first sample that breaks the rules: a gang beyond the quota is not left to run.
        wait_for(sampler.sample, lambda s: finished(s, list(jobs)) or bool(gang_violations([s], gangs, 2 * gang)),
                 timeout=THREE_TEAMS_RUN, interval=1,
                 description="all three teams' RayJobs to finish (or a sample with a partial gang or the quota exceeded)")
    samples = sampler.samples
    evidence.record("samples", compact(samples))
    holding = [sum(1 for j in s["jobs"].values() if j["quota"] and not j["finished"]) for s in samples]
    queued = [s["t"] for s in samples
              if sum(1 for j in s["jobs"].values() if j["quota"] and not j["finished"]) == 2
              and any(j["suspend"] and not j["quota"] and not j["pods"] for j in s["jobs"].values())]
    final = samples[-1]["jobs"]
    evidence.record("sample_count", len(samples))
    evidence.record("max_concurrent_admitted_gangs", max(holding))
    evidence.record("samples_two_running_one_queued", len(queued))
    evidence.record("outcome", {n: {"jobStatus": j["job"], "deploy": j["deploy"]} for n, j in final.items()})
    violations = gang_violations(samples, gangs, 2 * gang)
    evidence.record("violations", violations[:20])
    assert not violations, f"partial gangs held or the quota exceeded ({len(violations)} sampled): {violations[:5]}"
    assert max(holding) == 2, (
        f"expected two gangs admitted at once on a queue sized for two, saw at most {max(holding)}")
    assert queued, "no sample showed two gangs admitted and the third waiting suspended with no pods"
    failed = {n: j["job"] for n, j in final.items() if j["job"] != "SUCCEEDED"}
    assert not failed, f"expected all three RayJobs SUCCEEDED, these ended otherwise: {failed}"


def first_sample(samples: list[dict[str, Any]], job: str, check) -> dict[str, Any] | None:
    return next((s for s in samples if job in s["jobs"] and check(s, s["jobs"][job])), None)


class EvictedGang(NamedTuple):
    evicted: dict[str, Any] | None  # the first sample with the Workload evicted
    pods: list[str]  # the pods its gang had before that
    gone: dict[str, Any] | None  # the first later sample in which none of them is left


def evicted_gang(samples: list[dict[str, Any]], name: str) -> EvictedGang:
    evicted = first_sample(samples, name, lambda s, j: j["evicted"])
    if not evicted:
        return EvictedGang(None, [], None)
    at = samples.index(evicted)
    pods = sorted({p for s in samples[:at] if name in s["jobs"] for p in s["jobs"][name]["pod_names"]})
    gone = first_sample(samples[at:], name, lambda s, j: not set(pods) & set(j["pod_names"]))
    return EvictedGang(evicted, pods, gone)


@dataclass(frozen=True)
class EvictionBounds:
    """The profile's waitForPodsReady promises and the bounds ADM-4 judges against."""
    timeout_s: float  # waitForPodsReady's timeout, as the profile promises it  # platform-owned-ok: read
    backoff_s: float  # its back-off (backoffBase)
    bound: float  # eviction, pods gone and quota released: the timeout plus slack, from admission
    backoff_bound: float  # the requeue after eviction: the back-off plus its own length or the slack


@dataclass(frozen=True)
class StuckGang:
    """What the samples show of a gang that never gets Ready, from its admission to its requeue."""
    admitted: dict[str, Any] | None  # the first sample with the Workload admitted
    admitted_t: float | None  # admission, on the sampler's monotonic clock
    evicted_at: float | None  # the PodsReadyTimeout eviction's lastTransitionTime (epoch s)
    first_pods: list[str]  # the pods the gang had before its eviction
    gone: dict[str, Any] | None  # the first sample after the eviction with none of them left
    released: dict[str, Any] | None  # the first sample after the eviction with the gang's quota released
    requeued_at: float | None  # the Requeued condition's lastTransitionTime after the eviction (epoch s)
    requeues: int  # the highest requeueState count sampled


def require_wait_for_pods_ready(lab: Any, evidence: Any) -> None:
    """Records the profile's waitForPodsReady and fails the clause where it is off (null)."""
    wfpr = evidence.record("wait_for_pods_ready",
                           lab.profile["kueue"]["waitForPodsReady"])  # platform-owned-ok: its stated value, read
    if not wfpr:
        pytest.fail("kueue.waitForPodsReady is off on this platform (profile value null): "  # platform-owned-ok: judged
                    "nothing evicts a gang stuck short of Ready, so a gang with an unpullable worker holds its GPUs "
                    "indefinitely")


def record_eviction_bounds(lab: Any, evidence: Any) -> EvictionBounds:
    """The profile's waitForPodsReady timeout and back-off, with the two bounds derived from them (recorded)."""
    timeout_s = lab.profile.wait_for_pods_ready_s
    backoff_s = lab.profile.seconds("kueue.waitForPodsReady.backoffBase")  # platform-owned-ok: read
    bound = timeout_s + timeouts.FAIL_FAST_SLACK.seconds
    evidence.record(BOUND_S, bound)
    backoff_bound = evidence.record("backoff_bound_s", backoff_s + max(backoff_s, timeouts.BACKOFF_SLACK.seconds))
    return EvictionBounds(timeout_s, backoff_s, bound, backoff_bound)


def inject_unpullable_worker(lab: Any, ns: str, name: str, job: dict[str, Any], bound: float,
                             tmp_path: Path) -> dict[str, Any]:
    """Runs the straggler experiment with a worker that never comes (no delay: its image cannot be pulled) until
    the Workload is requeued or ``bound`` s pass; returns its journal."""
    return runner.run("straggler", {
        "kubeconfig": str(lab.kubeconfig), "context": lab.context, "namespace": ns,
        "rayjob": job, "rayjob_name": name,
        "delay_s": None, "wait_for": "requeued", "within_s": bound}, journal_path=tmp_path / "journal.json")


def wait_evicted_gang_gone(evidence: Any, sampler: Sampler, name: str) -> None:
    """Waits (sampling in the background) until the evicted gang of ``name`` has no pods left; a timeout is
    recorded, not raised."""
    # The experiment ends at the requeue, which can come (after a 10 s
    # back-off) before the evicted gang's pods have finished terminating:
    # keep sampling until they are gone, so the figure below is measured
    # rather than cut off. Whether that was within the bound is judged after.
    try:
        wait_for(lambda: evicted_gang(sampler.samples, name),
                 lambda gang: gang.evicted is None or gang.gone is not None, timeout=timeouts.OBJECT_DELETE,
                 description=f"the evicted gang of {name} to have no pods left")
    except WaitTimeout as exc:
        evidence.record("pods_gone_wait", str(exc)[:500])


def record_experiment(evidence: Any, journal: dict[str, Any], tmp_path: Path, key: str) -> Any:
    """Records the experiment's summary and journal, and its ``outcome`` activity's output as ``key``; returns
    that output."""
    evidence.record("experiment", runner.summary(journal))
    evidence.attach_file("chaostoolkit journal", tmp_path / "journal.json")
    return evidence.record(key, runner.output(journal, "outcome"))


def record_samples(evidence: Any, sampler: Sampler) -> list[dict[str, Any]]:
    """Records the sampler's samples (compacted) and its first errors; returns the samples."""
    samples = sampler.samples
    evidence.record("samples", compact(samples))
    evidence.record("sampler_errors", sampler.errors[:10])
    return samples


def measure_stuck_gang(samples: list[dict[str, Any]], name: str, outcome: dict[str, Any]) -> StuckGang:
    """The stuck gang's admission, eviction, pods gone, quota released and requeue, read from the samples (the
    requeue from the experiment's own probe where no sample caught it)."""
    admitted = first_sample(samples, name, lambda s, j: j["admitted"])
    evicted_at = condition_at(samples, name, "Evicted", reason=EVICTED_AT_PODS_READY_TIMEOUT)
    evicted, first_pods, gone = evicted_gang(samples, name)
    released = evicted and first_sample(samples[samples.index(evicted):], name,
                                        lambda s, j: not j["quota"] and not s["cq"]["reserved_gpus"]
                                        and not s["cq"]["reserving"])
    requeued_at = next((epoch(s["jobs"][name]["conditions"]["Requeued"]["at"]) for s in samples
                        if name in s["jobs"] and s["jobs"][name]["conditions"].get("Requeued", {}).get("status") == "True"
                        and evicted_at and epoch(s["jobs"][name]["conditions"]["Requeued"]["at"]) >= evicted_at), None)
    requeues = max((int((s["jobs"][name]["requeue"] or {}).get("count") or 0) for s in samples if name in s["jobs"]),
                   default=0)
    if requeued_at is None and evicted_at:
        # A short-lived Requeued=True between two 1 s samples: take it from the
        # experiment's own probe, which watched for exactly that condition.
        requeued_at = next((epoch(c["lastTransitionTime"]) for c in outcome["requeued"]["conditions"]
                            if c["type"] == "Requeued" and c["status"] == "True"
                            and epoch(c["lastTransitionTime"]) >= evicted_at), None)

    # Durations from admission are read on the sampler's monotonic clock (the
    # requeue's back-off, between two of the API server's own timestamps, on its).
    admitted_t = condition_t(samples, name, "Admitted")
    return StuckGang(admitted, admitted_t, evicted_at, first_pods, gone, released, requeued_at, requeues)


def record_stuck_gang_figures(evidence: Any, samples: list[dict[str, Any]], name: str,
                              stuck: StuckGang) -> dict[str, Any]:
    """Records the figures ADM-4 judges (durations from admission, the requeue, Ready and driver pods) and the
    gang's pods and quota second by second; returns the figures."""
    admitted_t, evicted_at, first_pods = stuck.admitted_t, stuck.evicted_at, stuck.first_pods
    gone, released, requeued_at, requeues = stuck.gone, stuck.released, stuck.requeued_at, stuck.requeues

    def since_admission(t: float | None) -> float | None:
        return None if t is None or admitted_t is None else round(t - admitted_t, 1)

    figures: EvictionFigures = evidence.record(FIGURES, {
        "evicted_after_admission_s": since_admission(condition_t(samples, name, "Evicted",
                                                                 reason=EVICTED_AT_PODS_READY_TIMEOUT)),
        "pods_gone_after_admission_s": since_admission(gone and gone["t"]),
        "quota_released_after_admission_s": since_admission(released and released["t"]),
        "requeued_after_eviction_s": None if None in (requeued_at, evicted_at) else round(requeued_at - evicted_at, 1),
        "requeue_count": requeues, "evicted_pods": first_pods,
        "pull_states": sorted({w for s in samples if name in s["jobs"] for w in s["jobs"][name]["waiting"]}),
        "max_ready_pods": max((s["jobs"][name]["ready"] for s in samples if name in s["jobs"]), default=0),
        "max_submitter_pods": max((s["jobs"][name]["submitter"] for s in samples if name in s["jobs"]), default=0),
        "released_sample": released and {"t": released["t"], "cq": released["cq"]},
    })
    if admitted_t is not None:  # the timeline's series: the gang's pods and quota, second by second
        evidence.record(GANG_PER_SECOND, [[round(s["t"] - admitted_t, 1), s["jobs"][name]["pods"],
                                           s["jobs"][name]["releasing"], s["jobs"][name]["reserved_gpus"]]
                                          for s in samples if name in s["jobs"]])
    return figures


def record_held_quota_cost(lab: Any, evidence: Any, gang: int, figures: dict[str, Any]) -> None:
    """Records the cost of the gang's GPUs held from admission until the eviction released them, where measured."""
    if figures["quota_released_after_admission_s"] is not None:
        record_idle_cost(lab.profile, evidence, gang * figures["quota_released_after_admission_s"],
                         "a gang that never gets Ready holding its quota from admission until its eviction released it")


def judge_eviction_and_requeue(name: str, job: dict[str, Any], sampler: Sampler, samples: list[dict[str, Any]],
                               outcome: dict[str, Any], bounds: EvictionBounds, stuck: StuckGang,
                               figures: dict[str, Any]) -> None:
    """ADM-4's verdict: admitted, evicted at its PodsReady timeout, pods gone and quota released within the bound,
    requeued after the promised back-off, and never a driver or a training step with a partial world."""
    timeout_s, backoff_s, bound, backoff_bound = bounds.timeout_s, bounds.backoff_s, bounds.bound, bounds.backoff_bound
    admitted, admitted_t, evicted_at, first_pods = stuck.admitted, stuck.admitted_t, stuck.evicted_at, stuck.first_pods
    gone, released, requeued_at, requeues = stuck.gone, stuck.released, stuck.requeued_at, stuck.requeues
    assert admitted and admitted_t is not None, f"the Workload of {name} was never seen admitted (samples: {len(samples)})"
    assert outcome["evicted"]["reached"] and evicted_at and figures["evicted_after_admission_s"] is not None, (
        f"the Workload of {name} was not evicted at its PodsReady timeout within {bound:g} s of submission; "
        f"its conditions: {outcome['evicted']['conditions']}")
    assert figures["evicted_after_admission_s"] <= bound, (
        f"evicted {figures['evicted_after_admission_s']} s after admission, beyond waitForPodsReady "  # platform-owned-ok
        f"{timeout_s:g} s + {timeouts.FAIL_FAST_SLACK.seconds:g} s slack")
    assert gone and figures["pods_gone_after_admission_s"] <= bound, (
        f"the evicted gang's pods {first_pods} were not all gone within {bound:g} s of admission "
        f"(gone after {figures['pods_gone_after_admission_s']} s)")
    assert released and figures["quota_released_after_admission_s"] <= bound, (
        f"the ClusterQueue did not release the evicted gang's quota within {bound:g} s of admission "
        f"(released after {figures['quota_released_after_admission_s']} s; last usage {samples[-1]['cq']})")
    assert outcome["requeued"]["reached"] and requeues >= 1 and requeued_at, (
        f"the evicted Workload was not requeued (Requeued condition {outcome['requeued']['conditions']}, "
        f"requeueState count {requeues})")
    assert backoff_s - 1 <= figures["requeued_after_eviction_s"] <= backoff_bound, (
        f"requeued {figures['requeued_after_eviction_s']} s after eviction, "
        + (f"expected a back-off of at least {backoff_s:g} s (backoffBase)"
           if figures["requeued_after_eviction_s"] < backoff_s - 1 else
           f"beyond the promised back-off of {backoff_s:g} s (backoffBase; bound {backoff_bound:g} s): "
           "an evicted gang waits longer than the platform says before it queues again"))
    gang_pods = gang_of(job)["pods"]
    assert figures["max_ready_pods"] < gang_pods, (
        f"{figures['max_ready_pods']} of {gang_pods} gang pods were Ready at once: the unpullable worker was not stuck")
    assert figures["max_submitter_pods"] == 0, (
        f"a driver started (submitter pods {figures['max_submitter_pods']}) although the gang was never whole")
    steps = parse_events(sampler.driver_logs.get(name, ""))
    assert not [e for e in steps if e["event"] == "step"], f"training steps ran with a partial world: {steps}"


@pytest.mark.clause("ADM-4")
# platform-owned-ok: ADM-4 judges the platform's own waitForPodsReady (its docstring names it); read, never set
def test_gang_that_never_gets_ready_is_evicted_and_requeued(lab, evidence, tmp_path) -> None:
    """When one worker of an admitted gang can never start (its image cannot be
    pulled), Kueue's waitForPodsReady MUST evict the Workload (Evicted, reason
    PodsReadyTimeout, or DeactivatedDueToRequeuingLimitExceeded where Kueue
    gives up requeuing it) and within the profile's waitForPodsReady timeout plus 60 s
    slack from admission all of the gang's pods MUST be gone and its quota
    released (the ClusterQueue reserves nothing), the Workload MUST be requeued
    after the profile's promised back-off (backoffBase) and no later than the
    promise plus its own length or 30 s, whichever is more, and no training
    step MUST run with a partial world (the driver never starts). A platform
    with waitForPodsReady off fails: nothing would evict a gang stuck short of
    Ready."""
    require_wait_for_pods_ready(lab, evidence)
    bounds = record_eviction_bounds(lab, evidence)
    gang = gang_gpus(lab)
    ns = lab.namespace("a", gpus=gang)
    name = lab.name("stuck")
    job = training_rayjob(lab, ns, name, steps=4)
    sampler = Sampler(lab, {name: ns}, lab.cluster_queue, logs=True)
    with evidence.phase("inject and observe"), sampler.in_background(1.0):
        journal = inject_unpullable_worker(lab, ns, name, job, bounds.bound, tmp_path)
        wait_evicted_gang_gone(evidence, sampler, name)
    outcome = record_experiment(evidence, journal, tmp_path, "outcome")
    samples = record_samples(evidence, sampler)
    stuck = measure_stuck_gang(samples, name, outcome)
    figures = record_stuck_gang_figures(evidence, samples, name, stuck)
    record_held_quota_cost(lab, evidence, gang, figures)
    judge_eviction_and_requeue(name, job, sampler, samples, outcome, bounds, stuck, figures)
    require_promises_configured(lab, evidence, bounds.timeout_s, bounds.backoff_s)


def require_promises_configured(lab, evidence, timeout_s: float | None, backoff_s: float | None) -> None:
    """The waitForPodsReady the profile promises is the one Kueue is
    configured with (its ConfigMap, read through the API); where that cannot
    be read, the certificate says the promise was taken on trust."""
    configured = evidence.record("kueue_configuration", kueue.configured_wait_for_pods_ready(lab.api))
    if configured["source"] is None:
        unread = f"kueue.waitForPodsReady: {configured['why']}"  # platform-owned-ok: its promise, named as unread
        evidence.record("promises_taken_on_trust", [unread])
    disagreements = kueue.promise_disagreements(configured, timeout_s, backoff_s)
    assert not disagreements, ("the platform's Kueue is not configured as the profile promises: "
                               + "; ".join(disagreements))


@dataclass(frozen=True)
class LateGang:
    """The late worker's gang as its driver and the sampler saw it."""
    started: list[dict[str, Any]]  # the driver's worker_group_started events
    steps: list[dict[str, Any]]  # the driver's step events
    clusters: list[str]  # every RayCluster the gang's pods belonged to
    gpu_pods: dict[str, dict[str, Any]]  # the GPU worker pods of the RayJob's final RayCluster
    ready: dict[str, float | None]  # their first Ready times (epoch s)


@dataclass(frozen=True)
class GangThrash:
    """Whether Kueue evicted or requeued the late worker's gang, and how long its pods took to start."""
    evictions: list[str]  # every Evicted condition seen, "<reason> at <time>"
    requeues: int  # the highest requeueState count sampled
    started_s: dict[str, float | None]  # each gang pod's creation to Ready (None: never Ready)


def inject_late_worker(lab: Any, ns: str, name: str, job: dict[str, Any], delay_s: float, slow_image: str | None,
                       tmp_path: Path) -> dict[str, Any]:
    """Runs the straggler experiment: one worker Ready ``delay_s`` late (a real pull of ``slow_image`` where the
    platform names one), until the RayJob finishes or is evicted; returns its journal."""
    return runner.run("straggler", {
        "kubeconfig": str(lab.kubeconfig), "context": lab.context, "namespace": ns,
        "rayjob": job, "rayjob_name": name, "delay_s": delay_s, "slow_image": slow_image or "",
        "wait_for": "finished_or_evicted", "within_s": timeouts.TRAINING_RUN.seconds},
        journal_path=tmp_path / "journal.json")


def record_world(evidence: Any, sampler: Sampler, name: str, outcome: dict[str, Any]) -> LateGang:
    """Records the gang's RayClusters, its GPU workers' Ready times and the world sizes its driver saw."""
    events = parse_events(sampler.driver_logs.get(name, ""))
    started = [e for e in events if e["event"] == "worker_group_started"]
    steps = [e for e in events if e["event"] == "step"]
    clusters = sorted({v["cluster"] for v in sampler.pod_ready.values() if v["job"] == name})
    evidence.record("rayclusters", clusters)  # more than one: the gang was evicted and requeued
    gpu_pods = {p: v for p, v in sampler.pod_ready.items()
                if v["job"] == name and v["gpus"] and clusters and v["cluster"] == outcome["status"]["rayClusterName"]}
    ready = {p: epoch(v["ready"]) for p, v in gpu_pods.items()}
    evidence.record("worker_ready", {p: v["ready"] for p, v in gpu_pods.items()})
    evidence.record("world_sizes", {"worker_group_started": [e["world_size"] for e in started],
                                    "steps": [e["world_size"] for e in steps]})
    return LateGang(started, steps, clusters, gpu_pods, ready)


def record_evictions(evidence: Any, sampler: Sampler, name: str, outcome: dict[str, Any]) -> GangThrash:
    """Records every eviction and requeue of the gang's Workload, and each gang pod's creation-to-Ready time."""
    evictions = sorted({f"{c['reason']} at {c['at']}" for smp in sampler.samples
                        for c in [smp["jobs"].get(name, {}).get("conditions", {}).get("Evicted")]
                        if c and c["status"] == "True"})
    requeues = max((int((smp["jobs"][name]["requeue"] or {}).get("count") or 0) for smp in sampler.samples
                    if name in smp["jobs"]), default=0)
    if outcome.get("evicted"):
        evictions = sorted({*evictions, f"{outcome['evicted']['reason']} at {outcome['evicted']['lastTransitionTime']}"})
    evidence.record("evictions", evictions)
    evidence.record("requeues", requeues)
    # Every pod of the gang (head included, each RayCluster), from creation to
    # Ready (null: never Ready): an eviction whose other pods were slow too
    # says the gang's start, not the straggler, outran waitForPodsReady.
    started_s = evidence.record("gang_created_to_ready_s", {
        p: (round(epoch(v["ready"]) - epoch(v["created"]), 1) if v["ready"] and v["created"] else None)
        for p, v in sorted(sampler.pod_ready.items()) if v["job"] == name})
    return GangThrash(evictions, requeues, started_s)


def judge_fault_injected(outcome: dict[str, Any], pulls: list[dict[str, Any]], slow_image: str | None) -> None:
    """The experiment ran without error, and the straggler's pull of the platform's slow image (where it names
    one) did not only fail."""
    assert not outcome.get("cause"), outcome["cause"]
    slow = [p for p in pulls if slow_image and p["container"] == straggler.SLOW_PULL_FIELD_PATH]
    failed = [p["message"] for p in slow if p["reason"] == "Failed"]
    if failed and not any(p["reason"] == "Pulled" for p in slow):
        pytest.fail(f"the straggler's pull of the platform's slow image failed ({'; '.join(failed)}), so the fault did not "
                    f"take effect: kueue.slowPullImage ({slow_image}) must name an image path this platform's nodes "
                    "pull from (null: the straggler's delay is simulated in its pod)")


def judge_gang_waited_whole(lab: Any, name: str, delay_s: float, outcome: dict[str, Any], world: LateGang,
                            thrash: GangThrash) -> None:
    """The gang was never evicted or requeued and kept one RayCluster, and the RayJob succeeded."""
    clusters, evictions, requeues, started_s = world.clusters, thrash.evictions, thrash.requeues, thrash.started_s
    assert not evictions and not requeues and len(clusters) <= 1, (
        f"Kueue evicted the gang of RayJob {name} ({'; '.join(evictions) or 'requeued'}; RayClusters {clusters}) "
        f"while one worker's image pull took {delay_s:g} s, within the platform's promised longest healthy pull: "
        f"a waitForPodsReady ({lab.profile['kueue']['waitForPodsReady']}) "  # platform-owned-ok: its stated value, named
        f"shorter than the platform's own pulls and starts makes gangs thrash, paying for every start twice (the "
        f"gang's pods, creation to Ready: {started_s})")
    assert outcome["reached"] and outcome["status"]["jobStatus"] == "SUCCEEDED", (
        f"RayJob {name} with a {delay_s} s straggler ended {outcome['status']} after {outcome['elapsed_s']} s, "
        f"expected SUCCEEDED")


def record_straggler_idle_cost(lab: Any, evidence: Any, world: LateGang, workers: int) -> None:
    """Records the straggler's lag and the cost of the early workers' GPUs held idle waiting for it (every GPU
    worker must have a Ready time)."""
    gpu_pods, ready = world.gpu_pods, world.ready
    assert len(ready) == workers and None not in ready.values(), (
        f"expected Ready times for {workers} GPU worker pods, sampled {ready}")
    last = max(ready.values())
    idle_s = sum((last - ready[p]) * v["gpus"] for p, v in gpu_pods.items())
    evidence.record("straggler_lag_s", round(last - min(ready.values()), 1))
    record_idle_cost(lab.profile, evidence, idle_s, "the gang's early workers waiting for a straggler's image pull")


def record_straggler_own_delay(evidence: Any, world: LateGang) -> list[float]:
    """Records, and returns, how long the straggler's own pod took from creation to Ready."""
    gpu_pods, ready = world.gpu_pods, world.ready
    # The fault took effect: the straggler's own pod took at least the delay
    # from creation to Ready (the other workers' start-up runs meanwhile, so
    # the lag between them can be shorter on a slow machine).
    late = [p for p, v in gpu_pods.items() if v["group"] == straggler.STRAGGLER_GROUP]
    own_s = [ready[p] - epoch(gpu_pods[p]["created"]) for p in late if gpu_pods[p]["created"]]
    evidence.record("straggler_created_to_ready_s", [round(x, 1) for x in own_s])
    return own_s


def judge_full_world_after_straggler(own_s: list[float], delay_s: float, world: LateGang, workers: int) -> None:
    """The fault took effect, and the worker group started and every one of the 6 steps ran with the full world."""
    started, steps = world.started, world.steps
    assert own_s and min(own_s) >= delay_s, (
        f"the straggler pod was Ready {own_s} s after its creation, less than its {delay_s} s delay: the fault "
        "did not take effect, so the clause observed nothing")
    assert started and all(e["world_size"] == workers for e in started), (
        f"expected the worker group to start with world size {workers}, saw {started}")
    assert steps and all(e["world_size"] == workers for e in steps), (
        f"expected every step with world size {workers}, saw {[(e['step'], e['world_size']) for e in steps]}")
    assert steps[0]["step"] == 1 and len(steps) == 6, f"expected steps 1..6, saw {[e['step'] for e in steps]}"


@pytest.mark.clause("ADM-3")
def test_late_worker_delays_training_without_splitting_it(lab, evidence, tmp_path) -> None:
    """When one worker of an admitted gang becomes Ready late because its image
    pull takes as long as the platform promises a healthy pull may take
    (profile kueue.longestHealthyPull; a real pull through the platform's slow
    path, kueue.slowPullImage, where it names one), the gang MUST wait for
    it: its Workload MUST never be evicted or requeued and it MUST keep one
    RayCluster (a waitForPodsReady shorter than the platform's own pulls makes
    gangs thrash),
    the worker group MUST start and every step run with the full world size,
    never a partial one, and the job MUST succeed. The accelerator time the
    early workers held idle while waiting is reported in GPU-hours and money
    (profile cost.gpuHourPrice)."""
    delay_s = evidence.record("promised_longest_healthy_pull_s", lab.profile.seconds("kueue.longestHealthyPull"))
    # The platform's own slow path when it names one (a real pull); else a simulated pull in the pod.
    slow_image = evidence.record("slow_pull_image", lab.profile["kueue"]["slowPullImage"])  # platform-owned-ok: its path, read
    workers = 2
    ns = lab.namespace("a", gpus=gang_gpus(lab, workers))
    name = lab.name("late")
    job = training_rayjob(lab, ns, name, workers=workers, steps=6)
    sampler = Sampler(lab, {name: ns}, lab.cluster_queue, logs=True)
    with evidence.phase("inject and observe"), sampler.in_background(1.0):
        journal = inject_late_worker(lab, ns, name, job, delay_s, slow_image, tmp_path)
    pulls = evidence.record("straggler_pulls", straggler.pulls(str(lab.kubeconfig), ns, lab.context))
    outcome = record_experiment(evidence, journal, tmp_path, "rayjob")
    world = record_world(evidence, sampler, name, outcome)
    thrash = record_evictions(evidence, sampler, name, outcome)
    judge_fault_injected(outcome, pulls, slow_image)
    judge_gang_waited_whole(lab, name, delay_s, outcome, world, thrash)
    record_straggler_idle_cost(lab, evidence, world, workers)
    own_s = record_straggler_own_delay(evidence, world)
    judge_full_world_after_straggler(own_s, delay_s, world, workers)
    require_promises_configured(lab, evidence, lab.profile.wait_for_pods_ready_s,  # platform-owned-ok: read
                                lab.profile.seconds("kueue.waitForPodsReady.backoffBase"))  # platform-owned-ok
