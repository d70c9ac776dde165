"""The figures fault clauses record and the report reads back: one typed contract.

GCS-1 and GCS-2 record :class:`HeadOomFigures` under evidence key
``figures`` (GCS-1 with its availability by phase, :class:`PhaseWindow`),
ADM-4 records :class:`EvictionFigures` there. ``reports/timeline.py``
reads them through these types, never through a dotted string: a key
renamed on one side and not the other is a type error (mypy, in `bin/rayproof test`).
The other keys the timeline draws are the names below, which the clauses
record under: neither side spells them.
"""
from __future__ import annotations

from typing import Any, Mapping, TypedDict, cast

FIGURES = "figures"  # the evidence key both record them under
AVAILABILITY_BY_PHASE = "availability_by_phase"  # GCS-1's, beside them

# The other evidence keys the timeline draws, one name for the clause that
# records each and the report that reads it. Series are rows of
# [seconds from the clause's origin, value, ...].
AVAILABILITY_PER_SECOND = "availability_per_second"  # GCS-1: [s, availability]
STEPS_SINCE_KILL = "steps_since_kill"  # TRN-1: [s, step]
CHECKPOINTS_SINCE_KILL = "checkpoints_since_kill"  # TRN-1: [s, step checkpointed]
KILL_TO_WORKER_GROUP_RESTART_S = "kill_to_worker_group_restart_s"  # TRN-1
KILL_TO_PROGRESS_S = "kill_to_progress_s"  # TRN-1: training past its last step before the kill
PROMISED_FAIL_FAST_BOUND_S = "promised_fail_fast_bound_s"  # TRN-1, NET-1, NET-4: the platform's promise
FAILED_AFTER_PROCESS_GROUP_SETUP_S = "failed_after_process_group_setup_s"  # NET-1
BOUND_S = "bound_s"  # ADM-4 (waitForPodsReady + slack), OPS-1
GANG_PER_SECOND = "gang_per_second"  # ADM-4: [s, pods holding, pods releasing, GPUs reserved]


class HeadOomFigures(TypedDict, total=False):
    """When a Ray head was OOM-killed and back (epoch seconds, and seconds from the pressure job's submission)."""

    oom_sample: dict[str, Any] | None  # the sample that first showed the kill (not recorded)
    oom_at: float | None
    ready_at: float | None
    inject_to_oom_s: float | None
    inject_to_head_ready_s: float | None
    oom_to_head_ready_s: float | None
    # GCS-1 only: the RayService back as Ray sees it.
    apps_running_at: float
    inject_to_apps_running_s: float
    nodes_back_at: float | None
    inject_to_nodes_back_s: float | None
    # GCS-2 only: the other team's victim RayJob settled.
    inject_to_victim_settled_s: float | None


class PhaseWindow(TypedDict, total=False):
    """The load generator's requests over one phase of GCS-1's event."""

    seconds: float
    sent: int
    ok: int
    failed: int
    availability: float


class EvictionFigures(TypedDict, total=False):
    """ADM-4's stuck gang, in seconds from its admission (the requeue from its eviction)."""

    evicted_after_admission_s: float | None
    pods_gone_after_admission_s: float | None
    quota_released_after_admission_s: float | None
    requeued_after_eviction_s: float | None
    requeue_count: int
    evicted_pods: Any
    pull_states: list[str]
    max_ready_pods: int
    max_submitter_pods: int
    released_sample: Any


def head_oom_figures(evidence: Mapping[str, Any]) -> HeadOomFigures:
    return cast(HeadOomFigures, evidence.get(FIGURES) or {})


def eviction_figures(evidence: Mapping[str, Any]) -> EvictionFigures:
    return cast(EvictionFigures, evidence.get(FIGURES) or {})


def phase_windows(evidence: Mapping[str, Any]) -> dict[str, PhaseWindow]:
    return cast(dict[str, PhaseWindow], evidence.get(AVAILABILITY_BY_PHASE) or {})
