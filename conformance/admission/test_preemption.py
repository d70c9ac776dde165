"""Preemption as a whole gang (ADM-5): the design's higher-priority job that needs the same nodes."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from conformance.training_jobs import DriverLog, gang_gpus, training_rayjob, wait_settled_checkpoint
from core import timeouts
from core.waiting import WaitTimeout, wait_for

pytestmark = pytest.mark.slow

STEPS = 40
STEP_TIME_S = 1.0


@dataclass(frozen=True)
class PodSampler:
    """A background thread appending a sample of both gangs' Ray pods to ``samples`` every second until ``stop``."""
    samples: list[dict]
    stop: threading.Event
    thread: threading.Thread


def submit_low_priority_training(lab: Any, low_ns: str, pcs: dict[str, Any]) -> str:
    """Submits the lower-priority training RayJob (the victim) in ``low_ns``; returns its name."""
    low = lab.name("low")
    lab.create_ray(low_ns, "rayjobs", training_rayjob(lab, low_ns, low, steps=STEPS, step_time_s=STEP_TIME_S,
                                                     max_failures=1, priority_class=pcs["low"]))
    return low


def ray_pods(lab: Any, ns: str) -> tuple[int, int]:
    """(running and not being deleted, running but terminating) Ray pods of ``ns``."""
    running = [p for p in lab.pods(ns, "ray.io/node-type") if p.status.phase == "Running"]
    terminating = sum(1 for p in running if p.metadata.deletion_timestamp is not None)
    return len(running) - terminating, terminating


def pod_sampler(lab: Any, log: DriverLog, low_ns: str, high_ns: str) -> PodSampler:
    """A sampler, not yet started, of the victim's and the high job's Ray pods (refreshing the victim's driver
    log each time)."""
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            try:
                log.refresh()
                low_live, low_terminating = ray_pods(lab, low_ns)
                high_live, high_terminating = ray_pods(lab, high_ns)
                samples.append({"t": round(time.time(), 1), "low_running": low_live, "low_terminating": low_terminating,
                                "high_running": high_live, "high_terminating": high_terminating})
            except Exception as exc:  # noqa: BLE001 - a missed sample is recorded, not fatal
                samples.append({"t": round(time.time(), 1), "error": type(exc).__name__})

    return PodSampler(samples, stop, threading.Thread(target=sample, name="adm5-sampler", daemon=True))


def inject_high_priority_job(lab: Any, evidence: Any, pods: PodSampler, high_ns: str, high: str,
                             pcs: dict[str, Any]) -> float:
    """Starts sampling and submits the higher-priority RayJob ``high``; returns when (epoch s) it was submitted."""
    with evidence.phase("inject"):
        pods.thread.start()
        preempted_at = time.time()
        lab.create_ray(high_ns, "rayjobs", training_rayjob(lab, high_ns, high, steps=6, max_failures=0,
                                                          priority_class=pcs["high"]))
    return preempted_at


def wait_victim_preempted(lab: Any, evidence: Any, low_ns: str, low: str, high: str, preemption: Any) -> None:
    """Waits for the victim's Workload to show Preempted (failing the clause if it does not) and records its
    conditions."""
    def victim_workload() -> list[dict]:
        return [c for w in lab.workloads(low_ns) for c in (w.get("status") or {}).get("conditions") or []]
    try:
        conds = wait_for(victim_workload,
                         lambda cs: any(c["type"] == "Preempted" and c["status"] == "True" for c in cs),
                         timeout=timeouts.CONTROLLER_RECONCILE, interval=1,
                         description=f"the Workload of {low} to show Preempted")
    except WaitTimeout as exc:
        pytest.fail(f"the higher-priority RayJob {high} did not preempt the running lower-priority gang {low} "
                    f"within {timeouts.CONTROLLER_RECONCILE.seconds:g} s (the platform's ClusterQueue "
                    f"{lab.cluster_queue}: preemption {preemption}); the victim's conditions: {exc.last_value}")
    evidence.record("victim_conditions", [{k: c.get(k) for k in ("type", "status", "reason")} for c in conds])


def wait_victim_pods_deleted(lab: Any, evidence: Any, low_ns: str, low: str) -> None:
    """Waits for every pod of the preempted gang to be deleted and records what was left."""
    gone = wait_for(lambda: [p.metadata.name for p in lab.pods(low_ns, "ray.io/node-type")],
                    lambda left: not left, timeout=timeouts.OBJECT_DELETE, interval=1,
                    description=f"every pod of the preempted gang {low} to be deleted")
    evidence.record("victim_pods_after_preemption", gone)


def wait_both_finished(lab: Any, low_ns: str, low: str, high_ns: str, high: str) -> tuple[dict, dict]:
    """Waits for the high-priority job, then the readmitted victim, to finish; returns (high, low) statuses."""
    high_status = lab.wait_rayjob(high_ns, high, lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                                  timeout=timeouts.TRAINING_RUN, description="high-priority job finished")
    low_status = lab.wait_rayjob(low_ns, low, lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                                 timeout=timeouts.TRAINING_RUN, description="preempted job readmitted and finished")
    return high_status, low_status


def record_overlap_and_resume(evidence: Any, samples: list[dict], log: DriverLog, preempted_at: float,
                              ckpt: dict[str, Any], high_status: dict, low_status: dict) -> tuple[list[dict], list[dict]]:
    """Records whether both gangs ran side by side, the checkpoint the victim resumed from and both outcomes;
    returns (samples with both gangs running, checkpoints restored after the preemption)."""
    overlap = [s for s in samples if s.get("low_running") and s.get("high_running")]
    # One gang's pods in their termination grace period while the other's run
    # (the victim's at preemption, the winner's when the victim is readmitted):
    # the GPUs are briefly double-booked, because Kueue releases quota once the
    # RayJob is suspended or finished and the pods' grace period runs after.
    # Measured, not failed.
    grace_overlap = [s for s in samples if (s.get("low_terminating") and s.get("high_running"))
                     or (s.get("high_terminating") and s.get("low_running"))]
    evidence.record("gang_in_grace_period_beside_other_s", len(grace_overlap))
    restored = [e for e in log.events("checkpoint_restored") if e["ts"] > preempted_at]
    evidence.record("samples", len(samples))
    evidence.record("samples_with_both_gangs_running", overlap[:5])
    evidence.record("checkpoint_before_preemption", ckpt["step"])
    evidence.record("restored_step", restored[0]["step"] if restored else None)
    evidence.record("high", {k: high_status.get(k) for k in ("jobStatus", "jobDeploymentStatus")})
    evidence.record("low", {k: low_status.get(k) for k in ("jobStatus", "jobDeploymentStatus", "failed")})
    return overlap, restored


def judge_preemption_and_resume(low: str, high: str, ckpt: dict[str, Any], high_status: dict, low_status: dict,
                                overlap: list[dict], restored: list[dict]) -> None:
    """ADM-5's verdict: the high job succeeded, no victim pod ran beside it, and the victim resumed from a
    checkpoint at least as new as its last before the preemption and succeeded."""
    assert high_status.get("jobStatus") == "SUCCEEDED", f"the high-priority job {high} ended {high_status}"
    assert not overlap, (
        f"pods of the preempted gang kept running, not even terminating, beside the new gang ({len(overlap)} samples, "
        f"first {overlap[0]})")
    assert restored, f"the preempted job {low} did not restore a checkpoint after readmission (started from step 0)"
    assert restored[0]["step"] >= ckpt["step"], (
        f"the preempted job resumed from step {restored[0]['step']}, older than its checkpoint {ckpt['step']} "
        "taken before the preemption")
    assert low_status.get("jobStatus") == "SUCCEEDED", f"the preempted job {low} ended {low_status}"


@pytest.mark.clause("ADM-5")
def test_higher_priority_job_preempts_whole_gang_and_victim_resumes(lab, evidence) -> None:
    """A higher-priority RayJob that needs the quota of a running lower-priority
    training RayJob MUST preempt it as a whole gang: the victim's Workload shows
    Preempted, every one of its pods is deleted (none runs beside the new gang
    other than in its termination grace period, which is measured), and when
    the quota frees the victim MUST be readmitted and resume from a checkpoint
    at least as new as its last one before the preemption (not step 0) and
    succeed."""
    pcs = lab.profile["kueue"]["priorityClasses"]
    low_ns, high_ns = lab.namespace("low", gpus=gang_gpus(lab)), lab.namespace("high", gpus=gang_gpus(lab))
    preemption = evidence.record("cluster_queue_preemption", lab.cluster_queue_spec().get("preemption"))
    low = submit_low_priority_training(lab, low_ns, pcs)
    log = DriverLog(lab, low_ns, low)
    with evidence.phase("steady state"):
        ckpt, _ = wait_settled_checkpoint(log, last_step_below=STEPS - 10)

    # Sample the victim's pods and the high job's pods from submission on, to
    # see whether both gangs ever ran side by side.
    pods = pod_sampler(lab, log, low_ns, high_ns)
    high = lab.name("high")
    preempted_at = inject_high_priority_job(lab, evidence, pods, high_ns, high, pcs)
    try:
        with evidence.phase("observe"):
            wait_victim_preempted(lab, evidence, low_ns, low, high, preemption)
            wait_victim_pods_deleted(lab, evidence, low_ns, low)
            high_status, low_status = wait_both_finished(lab, low_ns, low, high_ns, high)
            log.refresh()
    finally:
        pods.stop.set()
        pods.thread.join(timeout=10)
    overlap, restored = record_overlap_and_resume(evidence, pods.samples, log, preempted_at, ckpt, high_status, low_status)
    judge_preemption_and_resume(low, high, ckpt, high_status, low_status, overlap, restored)
