"""A fault clause's event on one time axis, drawn from its recorded evidence.

Every mark is a figure the clause measured (the certificate's evidence shows
the same numbers), in seconds from the moment the clause counts from: the
fault's injection (GCS-1), the worker's preemption (TRN-1), the gang's
admission (ADM-4), the process group forming (NET-1). Phases with a measured
availability (GCS-1's load generator) are drawn as bars under the marks, and
the platform's promised bound as a dashed line. The series the clause
recorded behind its figures are drawn against a second axis: GCS-1's
availability each second, TRN-1's steps and checkpoints, ADM-4's gang pods
and reserved GPUs each second. A clause whose evidence lacks
the figures (it failed before measuring them) has no timeline.
"""
from __future__ import annotations

import io
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from core.figures import (
    AVAILABILITY_PER_SECOND,
    BOUND_S,
    CHECKPOINTS_SINCE_KILL,
    FAILED_AFTER_PROCESS_GROUP_SETUP_S,
    GANG_PER_SECOND,
    KILL_TO_PROGRESS_S,
    KILL_TO_WORKER_GROUP_RESTART_S,
    PROMISED_FAIL_FAST_BOUND_S,
    STEPS_SINCE_KILL,
    eviction_figures,
    head_oom_figures,
    phase_windows,
)


@dataclass
class Timeline:
    clause: str
    origin: str  # what t = 0 is
    marks: list[tuple[str, float]]  # (what happened, seconds from the origin), each a recorded figure
    phases: list[tuple[str, float, float, float]] = field(default_factory=list)  # (name, start, end, availability)
    bound: tuple[str, float] | None = None  # the platform's promise, from the same origin
    # Measured series behind the marks, drawn against a second axis in ``unit``:
    # (name, [(seconds from the origin, value)]).
    series: list[tuple[str, list[tuple[float, float]]]] = field(default_factory=list)
    unit: str = ""


def _marks(named: list[tuple[str, object]]) -> list[tuple[str, float]]:
    """The (label, figure) pairs whose figure was measured (a number)."""
    return [(label, float(value)) for label, value in named if isinstance(value, (int, float))]


def _series(evidence: dict[str, Any], key: str, column: int) -> list[tuple[float, float]]:
    """Column ``column`` of a recorded series (rows of [seconds, value, ...]), without missing values."""
    rows = evidence.get(key)
    if not isinstance(rows, list):
        return []
    return [(float(r[0]), float(r[column])) for r in rows
            if isinstance(r, list) and len(r) > column and all(isinstance(r[i], (int, float)) for i in (0, column))]


def _gcs1(evidence: dict[str, Any]) -> Timeline:
    figures = head_oom_figures(evidence)
    marks = _marks([("head OOM-killed", figures.get("inject_to_oom_s")),
                    ("Ray nodes back", figures.get("inject_to_nodes_back_s")),
                    ("head Ready again", figures.get("inject_to_head_ready_s")),
                    ("Serve apps RUNNING", figures.get("inject_to_apps_running_s"))])
    phases, start = [], 0.0
    windows = phase_windows(evidence)
    for name in ("inject_to_oom", "oom_to_head_ready", "head_ready_to_recovered", "tail"):
        phase = windows.get(name) or {}
        if isinstance(phase.get("seconds"), (int, float)) and isinstance(phase.get("availability"), (int, float)):
            phases.append((name.replace("_", " "), start, start + phase["seconds"], phase["availability"]))
            start += phase["seconds"]
    return Timeline("GCS-1", "head-pressure job submitted", marks, phases,
                    series=[("availability, each second", _series(evidence, AVAILABILITY_PER_SECOND, 1))],
                    unit="availability")


def _trn1(evidence: dict[str, Any]) -> Timeline:
    bound = evidence.get(PROMISED_FAIL_FAST_BOUND_S)
    return Timeline("TRN-1", "worker pod deleted mid-all-reduce",
                    _marks([("worker group restarted", evidence.get(KILL_TO_WORKER_GROUP_RESTART_S)),
                            ("training past its last step", evidence.get(KILL_TO_PROGRESS_S))]),
                    bound=("promised fail-fast bound", float(bound)) if isinstance(bound, (int, float)) else None,
                    series=[("training step", _series(evidence, STEPS_SINCE_KILL, 1)),
                            ("checkpoint saved", _series(evidence, CHECKPOINTS_SINCE_KILL, 1))],
                    unit="step")


def _adm4(evidence: dict[str, Any]) -> Timeline:
    figures = eviction_figures(evidence)
    marks = _marks([("evicted at the PodsReady timeout", figures.get("evicted_after_admission_s")),
                    ("gang's pods gone", figures.get("pods_gone_after_admission_s")),
                    ("quota released", figures.get("quota_released_after_admission_s"))])
    evicted, requeued = figures.get("evicted_after_admission_s"), figures.get("requeued_after_eviction_s")
    if isinstance(evicted, (int, float)) and isinstance(requeued, (int, float)):
        marks.append(("requeued", float(evicted + requeued)))
    bound = evidence.get(BOUND_S)
    return Timeline("ADM-4", "gang admitted", marks,
                    bound=("waitForPodsReady + slack", float(bound)) if isinstance(bound, (int, float)) else None,
                    series=[("gang pods holding resources", _series(evidence, GANG_PER_SECOND, 1)),
                            ("gang pods being released", _series(evidence, GANG_PER_SECOND, 2)),
                            ("GPUs reserved", _series(evidence, GANG_PER_SECOND, 3))],
                    unit="pods / GPUs")


def _net1(evidence: dict[str, Any]) -> Timeline:
    bound = evidence.get(PROMISED_FAIL_FAST_BOUND_S)
    return Timeline("NET-1", "process group began to form (collectives blocked)",
                    _marks([("training failed", evidence.get(FAILED_AFTER_PROCESS_GROUP_SETUP_S))]),
                    bound=("promised fail-fast bound", float(bound)) if isinstance(bound, (int, float)) else None)


_BUILDERS: dict[str, Callable[[dict[str, Any]], Timeline]] = {"GCS-1": _gcs1, "TRN-1": _trn1, "ADM-4": _adm4,
                                                              "NET-1": _net1}


def of(clause: dict[str, Any]) -> Timeline | None:
    """The clause's timeline, or None: not a fault clause, or nothing measured."""
    build = _BUILDERS.get(clause["id"])
    if build is None:
        return None
    timeline = build(clause.get("evidence") or {})
    return timeline if timeline.marks else None


def png(timeline: Timeline) -> bytes:
    """The timeline drawn as a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    ends = [s for _, s in timeline.marks] + [end for _, _, end, _ in timeline.phases]
    ends += [t for _, points in timeline.series for t, _ in points]
    if timeline.bound:
        ends.append(timeline.bound[1])
    span = max([*ends, 1.0]) * 1.08
    start = min([0.0, *(t for _, points in timeline.series for t, _ in points)])
    fig, ax = plt.subplots(figsize=(9, 3.2 if timeline.series else 2.6), dpi=100)
    try:
        ax.set_xlim(start - span * 0.02, span)
        ax.set_ylim(0, 1.25)
        ax.set_yticks([])
        ax.set_xlabel(f"seconds since {timeline.origin}")
        ax.set_title(f"{timeline.clause}: {timeline.origin} at 0 s", fontsize=10, loc="left")
        ax.axvline(0, color="black", linewidth=1.5)
        for name, start, end, availability in timeline.phases:
            ax.barh(0.12, end - start, left=start, height=0.16,
                    color=plt.cm.RdYlGn(max(0.0, min(1.0, (availability - 0.9) * 10))), edgecolor="white")
            ax.text((start + end) / 2, 0.12, f"{availability:.1%}", ha="center", va="center", fontsize=7)
        for index, (label, seconds) in enumerate(sorted(timeline.marks, key=lambda m: m[1])):
            ax.axvline(seconds, color="tab:blue", linewidth=1)
            ax.text(seconds, 0.3 + 0.22 * (index % 4), f" {label}\n {seconds:g} s", fontsize=7, va="bottom")
        if timeline.bound:
            label, seconds = timeline.bound
            ax.axvline(seconds, color="tab:red", linestyle="--", linewidth=1)
            ax.text(seconds, 1.2, f"{label} {seconds:g} s ", color="tab:red", fontsize=7, ha="right", va="top")
        drawn = [(name, points) for name, points in timeline.series if points]
        if drawn:
            values = ax.twinx()
            values.set_ylabel(timeline.unit, fontsize=8)
            values.tick_params(labelsize=7)
            for (name, points), colour in zip(drawn, ("tab:green", "tab:orange", "tab:purple")):
                values.step([t for t, _ in points], [v for _, v in points], where="post", color=colour,
                            linewidth=1.5, label=name)
            top = max([v for _, points in drawn for _, v in points] + [1.0])
            values.set_ylim(min([v for _, points in drawn for _, v in points] + [0.0]) - 0.05 * top, top * 1.3)
            values.legend(loc="upper left", fontsize=7, frameon=False)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", metadata={"Software": None})
        return out.getvalue()
    finally:
        plt.close(fig)


def allure_full_name(nodeid: str) -> str:
    """The ``fullName`` allure-pytest gives the test ``nodeid`` (``pkg.module#function``, no parameters)."""
    path, _, rest = nodeid.partition("::")
    names = rest.split("[", 1)[0].split("::")
    return ".".join(path.removesuffix(".py").split("/") + names[:-1]) + "#" + names[-1]


def attach_to_allure(allure_dir: Path, clauses: list[dict[str, Any]]) -> list[str]:
    """Add each clause's timeline (the certificate's PNG) to the Allure result
    of its test in ``allure_dir``; returns the clauses whose timeline was
    attached. Allure's results are written by the workers during the run; the
    timeline is drawn once the clause's evidence is whole, so it is added here."""
    drawn = {}
    for clause in clauses:
        line = of(clause)
        if line is not None and clause.get("test"):
            drawn[allure_full_name(clause["test"])] = (clause["id"], line)
    attached: list[str] = []
    for result_file in sorted(Path(allure_dir).glob("*-result.json")) if drawn else []:
        result = json.loads(result_file.read_text())
        found = drawn.get(result.get("fullName", ""))
        if found is None:
            continue
        clause_id, line = found
        source = f"{uuid.uuid4()}-attachment.png"
        (result_file.parent / source).write_bytes(png(line))
        result.setdefault("attachments", []).append({"name": f"{clause_id} timeline", "source": source,
                                                     "type": "image/png"})
        result_file.write_text(json.dumps(result))
        attached.append(clause_id)
    return attached
