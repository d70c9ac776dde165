"""Run a chaostoolkit experiment of ``chaos/experiments/`` from Python.

The pytest clauses inject every fault this way, so the experiment a user runs
with ``chaos run`` and the clause are the same code path: steady-state
hypothesis before and after, the method, and rollbacks that always run (one
that fails raises :class:`RollbackFailed`, though chaoslib calls the run
completed). The journal (chaostoolkit's record of every activity, its output and timing) is
returned and attached to the clause's evidence.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

EXPERIMENTS = Path(__file__).resolve().parent / "experiments"


def load(name: str) -> dict[str, Any]:
    path = EXPERIMENTS / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in EXPERIMENTS.glob("*.json"))
        raise FileNotFoundError(f"no experiment {name!r} in {EXPERIMENTS}; known: {', '.join(known)}")
    experiment: dict[str, Any] = json.loads(path.read_text())
    return experiment


def run(name: str, configuration: Mapping[str, Any], journal_path: Path | None = None) -> dict[str, Any]:
    """Run experiment ``name`` with ``configuration`` (its declared variables);
    return the journal (also written to ``journal_path``)."""
    from chaoslib.experiment import run_experiment

    experiment = load(name)
    unknown = set(configuration) - set(experiment.get("configuration", {}))
    if unknown:
        raise ValueError(f"experiment {name} does not declare configuration {sorted(unknown)}")
    logging.getLogger("chaostoolkit").setLevel(logging.WARNING)
    journal = run_experiment(experiment, settings={"runtime": {"rollbacks": {"strategy": "always"}}},
                             experiment_vars=(dict(configuration), {}))
    if journal_path is not None:
        Path(journal_path).write_text(json.dumps(journal, indent=1, default=str))
    if _interrupted(journal):
        # chaoslib turns SIGTERM/Ctrl-C into an activity failure (rollbacks
        # still ran); the run as a whole must stop, as it would without it.
        raise KeyboardInterrupt(f"experiment {name} was interrupted")
    failed = [e for e in journal.get("rollbacks", []) if e.get("status") != "succeeded"]
    if failed:
        # chaoslib still calls such a run "completed": the fault may be left in
        # place on the cluster, which no clause may pass over.
        raise RollbackFailed(f"experiment {name}: rollback " + "; ".join(
            f"{e['activity']['name']!r} {e.get('status')}: {_error(e)}" for e in failed)
            + (f" (journal {journal_path})" if journal_path is not None else ""))
    finished: dict[str, Any] = journal
    return finished


def _error(entry: Mapping[str, Any]) -> str:
    """An activity's error in one line: chaoslib keeps the traceback as a list of lines, the last one the error."""
    exc = entry.get("exception") or entry.get("output")
    return str(exc[-1]).strip() if isinstance(exc, list) and exc else str(exc)


class RollbackFailed(RuntimeError):
    """A fault's rollback did not succeed: the fault may still be in place."""


def _interrupted(journal: Mapping[str, Any]) -> bool:
    if journal.get("status") in ("interrupted", "aborted"):
        return True
    return any("InterruptExecution" in str(e.get("exception")) or "KeyboardInterrupt" in str(e.get("exception"))
               for e in journal.get("run", []))


def output(journal: Mapping[str, Any], activity: str) -> Any:
    """The output of the method activity named ``activity``; raises with the
    activity's error when it failed."""
    for entry in journal.get("run", []):
        if entry["activity"]["name"] == activity:
            if entry.get("status") != "succeeded":
                raise AssertionError(f"experiment activity {activity!r} {entry.get('status')}: {_error(entry)}")
            return entry.get("output")
    raise AssertionError(f"experiment activity {activity!r} did not run (journal status {journal.get('status')}, "
                         f"deviated={journal.get('deviated')})")


def ended_at(journal: Mapping[str, Any], activity: str) -> float:
    """When the method activity named ``activity`` ended (epoch seconds, from
    the journal's UTC ``end`` stamp): the moment a fault was in place."""
    from datetime import datetime, timezone

    for entry in journal.get("run", []):
        if entry["activity"]["name"] == activity and entry.get("end"):
            return datetime.fromisoformat(entry["end"]).replace(tzinfo=timezone.utc).timestamp()
    raise AssertionError(f"experiment activity {activity!r} did not end (journal status {journal.get('status')})")


def summary(journal: Mapping[str, Any]) -> dict[str, Any]:
    """The journal in a few fields, for the clause's evidence."""
    return {"status": journal.get("status"), "deviated": journal.get("deviated"),
            "duration_s": round(float(journal.get("duration") or 0), 1),
            "activities": [{"name": e["activity"]["name"], "status": e.get("status"),
                            "duration_s": round(float(e.get("duration") or 0), 1)}
                           for e in [*journal.get("run", []), *journal.get("rollbacks", [])]]}
