"""Training RayJobs as the clauses submit them, and reading what they did.

Shared by the Kubernetes clauses: the platform's golden RayJob running the
training (one Ray Train worker per worker pod), submitted through Kueue, and the
``RAYPROOF_EVENT`` lines of its driver read back from the submitter pod's log.
"""
from __future__ import annotations

from typing import Any

from core import timeouts
from core.figures import PROMISED_FAIL_FAST_BOUND_S
from core.waiting import wait_for
from fixtures import manifests as mf
from fixtures.events import parse_events


def training_rayjob(lab: Any, namespace: str, name: str, *, workers: int = 2, steps: int = 12,
                    step_time_s: float = 0.0, max_failures: int = 0,
                    priority_class: str | None = None, backoff_limit: int = 0, run_name: str | None = None,
                    checkpoint_every: int | None = None) -> dict[str, Any]:
    """The platform's golden RayJob running the FSDP training, one Ray Train
    worker per worker pod, for ``namespace`` (not yet created), queued to the
    team's LocalQueue."""
    entry = mf.training_entrypoint(lab.profile, run_name or name, world_size=workers, steps=steps,
                                   step_time_s=step_time_s, max_failures=max_failures,
                                   checkpoint_every=checkpoint_every)
    return lab.rayjob(namespace, name, entry, workers=workers, queue=lab.queue, priority_class=priority_class,
                      backoff_limit=backoff_limit)


def driver_events(lab: Any, namespace: str, rayjob: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The driver's events (all submitter pods of the RayJob, oldest first)."""
    events = parse_events(lab.submitter_logs(namespace, rayjob))
    return [e for e in events if kind is None or e["event"] == kind]


def gang_gpus(lab: Any, workers: int = 2) -> int:
    """GPUs a gang of ``workers`` asks for (0 on a CPU-only profile)."""
    return mf.gang_gpus(lab.profile, workers)


class DriverLog:
    """A RayJob's driver events, accumulated across submitter pods that come
    and go (a suspended or retried RayJob's submitter is deleted with its logs)."""

    def __init__(self, lab: Any, namespace: str, rayjob: str):
        self.lab, self.namespace, self.rayjob = lab, namespace, rayjob
        self._seen: dict[str, dict[str, Any]] = {}

    def refresh(self) -> list[dict[str, Any]]:
        for event in driver_events(self.lab, self.namespace, self.rayjob):
            key = repr(sorted(event.items()))
            self._seen.setdefault(key, event)
        return self.events()

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        found = sorted(self._seen.values(), key=lambda e: e.get("ts", 0))
        return [e for e in found if kind is None or e["event"] == kind]


# Ray Train V2 registers a reported checkpoint only when its controller next
# polls the workers (~2 s); a failure inside that window resumes from the
# previous checkpoint. Faults are injected only after a checkpoint is this old.
CHECKPOINT_SETTLE_S = 4.0


def wait_settled_checkpoint(log: DriverLog, *, last_step_below: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Wait until the run's latest checkpoint is at least CHECKPOINT_SETTLE_S
    older than its latest step, while that step is below ``last_step_below``
    (training still has work left); return (that checkpoint, that step).
    A run whose driver reports a failure first cannot reach that state: the
    wait ends there and fails with the driver's reason."""
    def latest() -> tuple[dict | None, dict | None, dict | None]:
        log.refresh()
        saved, steps, failed = log.events("checkpoint_saved"), log.events("step"), log.events("failure")
        return (saved[-1] if saved else None), (steps[-1] if steps else None), (failed[-1] if failed else None)

    ckpt, step, failure = wait_for(
        latest, lambda v: v[2] is not None or (v[0] is not None and v[1] is not None
                                               and v[1]["ts"] - v[0]["ts"] >= CHECKPOINT_SETTLE_S
                                               and v[1]["step"] < last_step_below),
        timeout=timeouts.TRAINING_RUN, interval=1,
        description=f"RayJob {log.namespace}/{log.rayjob}: a checkpoint at least {CHECKPOINT_SETTLE_S:g} s "
                    f"old while steps below {last_step_below} run")
    assert failure is None, (
        f"RayJob {log.namespace}/{log.rayjob}: training failed before the fault was injected "
        f"(after {failure.get('seconds')} s): {failure.get('reason')}")
    return ckpt, step


def collectives_in_flight(events: list[dict[str, Any]], at: float) -> list[dict[str, Any]]:
    """The collectives some rank was inside at wall time ``at``: its latest
    ``collective`` begin before ``at`` with no end before ``at``
    (``workloads/fsdp_train.py`` brackets each synchronised phase of a step)."""
    spans = [e for e in events if e["event"] == "collective"]
    latest: dict[tuple, dict[str, Any]] = {}
    for e in spans:
        if e["phase"] == "begin" and e["ts"] <= at:
            latest[(e["rank"], e["op"], e["step"])] = e
    in_flight = []
    for key, begin in sorted(latest.items(), key=lambda kv: kv[1]["ts"]):
        ended = [e for e in spans if e["phase"] == "end" and (e["rank"], e["op"], e["step"]) == key
                 and begin["ts"] <= e["ts"] <= at]
        if not ended:
            in_flight.append({"rank": key[0], "op": key[1], "step": key[2], "began_s_before": round(at - begin["ts"], 3)})
    return in_flight


def rank_state_at(events: list[dict[str, Any]], rank: int, at: float) -> dict[str, Any]:
    """Where rank ``rank`` was at wall time ``at``: inside the collective it
    last began before ``at`` (``inside``: its op, or None where it had ended
    it), how long it had been in, and when (if ever) that same process ended
    it after ``at`` (its next event; a restarted group's rank runs the step again)."""
    own = [e for e in events if e["event"] == "collective" and e["rank"] == rank]
    before = [e for e in own if e["ts"] <= at]
    last = before[-1] if before else None
    inside = last["op"] if last and last["phase"] == "begin" else None
    # Its next event closes the bracket it was in, or belongs to a worker group started after it died.
    after = next((e for e in own if e["ts"] > at), None)
    ended = after if (after and inside and after["phase"] == "end"
                      and (after["op"], after["step"]) == (last["op"], last["step"])) else None
    return {"rank": rank, "inside": inside, "last_event": last,
            "in_for_s": round(at - last["ts"], 3) if inside else None,
            "ended_after_s": round(ended["ts"] - at, 3) if ended else None}


def newest_checkpoint_begun(events: list[dict[str, Any]], before: float) -> int | None:
    """The newest step whose checkpoint some rank had begun saving before wall time ``before``.

    A pod deleted through the API is not stopped at that instant: its containers run until its
    kubelet kills them (real kubelet nodes: checkpoint 10 saved 0.21 s after a worker's
    force-deletion, and restored). So what a restart may restore is bounded by what was begun
    before the restart, not by the deletion."""
    begun = [e["step"] for e in events if e["event"] == "collective" and e["op"] == "checkpoint"
             and e["phase"] == "begin" and e["ts"] < before]
    return max(begun) if begun else None


def promised_fail_fast_bound(profile: Any, evidence: Any) -> float:
    """The platform's promise: how soon a training whose collectives cannot
    complete fails or restarts (profile ``training.maxCollectiveTimeout``)."""
    return evidence.record(PROMISED_FAIL_FAST_BOUND_S, profile.seconds("training.maxCollectiveTimeout"))


def collective_timeout_used(events: list[dict[str, Any]], evidence: Any) -> dict[str, Any] | None:
    """The collective timeout the training's process group was really given
    (its driver's ``process_group_setup`` event) and where it came from (the
    platform's environment, or Ray Train's default), recorded; None when the
    process group never began to form."""
    setups = [e for e in events if e["event"] == "process_group_setup"]
    starts = [e for e in events if e["event"] == "start"]
    if not setups:
        return evidence.record("collective_timeout", None)
    return evidence.record("collective_timeout", {"timeout_s": setups[0].get("timeout_s"),
                                                  "source": starts[0].get("timeout_source") if starts else None})


def require_timeout_within(used: dict[str, Any] | None, bound_s: float, consequence: str) -> None:
    """Fails the clause when the training ran with a collective timeout above
    the promised bound (``consequence`` says what that costs)."""
    assert used is not None, "the training never reported its process-group setup, so its timeout is unknown"
    timeout_s = float(used["timeout_s"])
    assert timeout_s <= bound_s, (
        f"the training ran with a collective timeout of {timeout_s:g} s (from {used['source']}), above the "
        f"platform's promised fail-fast bound of {bound_s:g} s: {consequence} for {timeout_s / 60:.0f} min")
