"""The training checks shared by the runtime tier's clauses and their self-tests (launching: fixtures/local_training.py)."""
from __future__ import annotations

import math
import time

from core import timeouts
from core.waiting import wait_for
from fixtures.local_ray import LocalRayCluster
from fixtures.local_training import TrainingRun, lost_work, start_training  # noqa: F401 - TrainingRun: the tests'


def training_cluster(local_ray, **kwargs) -> LocalRayCluster:
    """Head with no CPUs plus two 1-CPU workers: each training rank gets its own node."""
    cluster = local_ray(head_cpus=0, **kwargs)
    cluster.add_workers(2)
    return cluster


# ---------------------------------------------------------------------------
# Checks shared by the clauses and by their self-tests (which run them on a
# deliberately broken setup and expect them to fail).
# ---------------------------------------------------------------------------

STEPS = 30
CHECKPOINT_EVERY = 5
# Relative tolerance on the final loss of a resumed run against an
# uninterrupted one: restore is exact (same shards, same optimizer state, same
# data), so only reduction order could differ.
LOSS_RTOL = 1e-5


def final_loss(run: TrainingRun) -> float:
    finish = run.log.last("finish")
    assert finish is not None, f"training run has no 'finish' event; tail:\n{run.log.tail()}"
    return float(finish["loss"])


def check_resume_matches_uninterrupted(cluster: LocalRayCluster, evidence, *, storage_per_launch: bool = False) -> None:
    """An interrupted run relaunched under the same name ends with the uninterrupted run's loss."""
    common = dict(steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, seed=7, timeout_s=60)
    reference = start_training(cluster, "reference", "reference.log", **common)
    rc = reference.wait_exit()
    assert rc == 0, f"uninterrupted run exited {rc}; tail:\n{reference.log.tail()}"
    expected = evidence.record("reference_final_loss", final_loss(reference))

    interrupt_at = 2 * CHECKPOINT_EVERY + 2
    paced = dict(common, step_time_s=0.3)
    first = start_training(cluster, "resumed", "resumed-1.log", **paced)
    first.log.wait_for("step", lambda e: e["step"] >= interrupt_at, timeout=timeouts.TRAINING_RUN,
                       description=f"first launch to pass step {interrupt_at}")
    first.proc.kill()  # the driver dies with its head, as when a head pod is lost
    first.wait_exit(timeouts.PROCESS_EXIT)
    interrupted_at = max(e["step"] for e in first.steps())
    evidence.record("interrupted_after_step", interrupted_at)

    relaunch_options = dict(paced)
    if storage_per_launch:  # self-test: checkpoints written where the relaunch cannot see them
        relaunch_options["storage_path"] = str(cluster.workdir / "node-local-storage")
    second = start_training(cluster, "resumed", "resumed-2.log", **relaunch_options)
    rc = second.wait_exit()
    assert rc == 0, f"relaunched run exited {rc}; tail:\n{second.log.tail()}"
    restored = second.log.last("checkpoint_restored")
    assert restored is not None, (
        f"relaunch of run 'resumed' started from step 0 instead of a checkpoint (interrupted after step "
        f"{interrupted_at}); events: {[e['event'] for e in second.log.events()][:6]}")
    saved_steps = sorted({e["step"] for e in first.log.events("checkpoint_saved")})
    evidence.record("restored_step", restored["step"])
    evidence.record("checkpoints_saved_before_interruption", saved_steps)
    # Not bounded by K here: Ray Train V2 registers a reported checkpoint in its
    # run snapshot asynchronously, so a driver killed within about a second of
    # a save resumes from the checkpoint before it (measured; see the notes).
    evidence.record("steps_lost_on_relaunch", interrupted_at - restored["step"])
    assert restored["step"] in saved_steps and restored["step"] > 0, (
        f"relaunch restored step {restored['step']}, which is not one of the checkpoints saved before the "
        f"interruption {saved_steps}")
    got = evidence.record("resumed_final_loss", final_loss(second))
    assert abs(got - expected) <= LOSS_RTOL * abs(expected), (
        f"resumed run's final loss {got!r} differs from the uninterrupted run's {expected!r} "
        f"by more than {LOSS_RTOL:g} relative")


# Ray Train V2 registers a reported checkpoint when its controller next polls
# the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, default 2 s): a worker lost
# within that window of a save resumes from the checkpoint before (measured on
# Ray 2.60).  WL-TRN-2 therefore kills a node once the last checkpoint is
# older than that window, and then holds Ray to "at most K steps lost".
REGISTRATION_LAG_S = 2.0
PACED_STEP_S = 0.8


def check_worker_loss_recovers(cluster: LocalRayCluster, evidence, *, max_failures: int = 2) -> None:
    """A worker node killed mid-training: restart from the last checkpoint, lose at most K steps, finish."""
    run = start_training(cluster, "worker-loss", "worker-loss.log", steps=STEPS, checkpoint_every=CHECKPOINT_EVERY,
                         seed=3, timeout_s=60, max_failures=max_failures, step_time_s=PACED_STEP_S)
    settle_steps = math.ceil(REGISTRATION_LAG_S / PACED_STEP_S) + 1
    kill_after = 2 * CHECKPOINT_EVERY + settle_steps
    assert settle_steps < CHECKPOINT_EVERY, "the kill must land before the next checkpoint"
    run.log.wait_for("step", lambda e: e["step"] >= kill_after, timeout=timeouts.TRAINING_RUN,
                     description=f"training to pass step {kill_after}")
    victim = cluster.workers[-1]
    killed_at = time.time()
    cluster.kill_node(victim)
    evidence.record("killed_node", victim.name)
    # KubeRay replaces a lost worker pod; the fixture does the same.
    cluster.add_worker(cpus=1)
    rc = run.wait_exit()
    events = run.log.events()
    assert rc == 0, f"training did not survive the loss of node {victim.name}: exit {rc}; tail:\n{run.log.tail()}"
    lost = lost_work(events)
    assert lost["restored_step"] is not None, "training finished without restoring from a checkpoint after the node loss"
    evidence.record("lost_work", {k: v for k, v in lost.items() if k != "restore_ts"})
    evidence.record("kill_to_restore_s", round(lost["restore_ts"] - killed_at, 2))
    assert lost["restored_step"] == lost["last_checkpoint_before_failure"], (
        f"restored step {lost['restored_step']} is not the last checkpoint before the failure "
        f"({lost['last_checkpoint_before_failure']})")
    assert lost["first_step_after_restore"] == lost["restored_step"] + 1, (
        f"first step after restart is {lost['first_step_after_restore']}, expected {lost['restored_step'] + 1}")
    assert lost["steps_lost"] <= CHECKPOINT_EVERY, (
        f"{lost['steps_lost']} steps lost, more than the checkpoint interval {CHECKPOINT_EVERY}")
    finish = run.log.last("finish")
    assert finish and finish["step"] == STEPS, f"run finished at {finish and finish['step']} instead of step {STEPS}"


def check_blocked_collectives_fail_fast(cluster: LocalRayCluster, evidence, *, promised_timeout_s: int,
                                        configured_timeout_s: int) -> None:
    """With worker-to-worker traffic dropped, training fails within the promised timeout + slack, naming it."""
    a, b = cluster.workers[0], cluster.workers[1]
    cluster.block(a, b)
    run = start_training(cluster, "blocked", "blocked.log", steps=10, checkpoint_every=CHECKPOINT_EVERY,
                         timeout_s=configured_timeout_s, max_failures=0)
    bound = timeouts.Tier("collective_timeout_plus_slack", promised_timeout_s + timeouts.FAIL_FAST_SLACK.seconds,
                          "the platform's collective timeout plus the fail-fast slack")
    evidence.record("promised_timeout_s", promised_timeout_s)
    evidence.record("slack_s", timeouts.FAIL_FAST_SLACK.seconds)
    # The collective timeout starts to count when the process group begins to
    # form (the worker actors exist by then); worker start-up is not part of it.
    wait_for(lambda: run.log.last("process_group_setup") is not None or run.proc.poll() is not None,
             timeout=timeouts.RAY_CLUSTER_START, description="the training run to start forming its process group")
    try:
        rc = run.wait_exit(bound)
    except AssertionError as exc:
        raise AssertionError(
            f"training with blocked collectives was still running after {bound.seconds:g}s "
            f"(collective timeout {promised_timeout_s}s + slack {timeouts.FAIL_FAST_SLACK.seconds:g}s): "
            f"the job hangs instead of failing fast") from exc
    start = run.log.last("process_group_setup") or run.log.last("start")
    failure = run.log.last("failure")
    assert rc != 0 and failure is not None, f"training exited {rc} without a failure event; tail:\n{run.log.tail()}"
    elapsed = evidence.record("process_group_setup_to_failure_s", round(failure["ts"] - start["ts"], 2))
    evidence.record("failure_reason", failure["reason"])
    assert elapsed <= bound.seconds, f"failure surfaced after {elapsed}s, beyond {bound.seconds:g}s"
    assert any(w in failure["reason"].lower() for w in ("timed out", "timeout")), (
        f"failure reason does not name the timeout: {failure['reason']!r}")
    assert not run.steps(), f"{len(run.steps())} steps ran although the workers could not reach each other"
