"""Two certifications side by side: per clause, the outcome change and the
change of every measured figure; regressions flagged.

A certification is read from its evidence bundle (verified first: a bundle
that does not verify is not compared), its report directory, or its
``certification.json``. A figure is every number in a clause's evidence
(nested keys joined with dots) and the clause's duration.

What counts as a regression: a clause whose outcome got worse (passed to
failed, anything to error or missing), and, given a ranges file, a measured
figure beyond the range the reference runs showed, widened by the file's
slack, *in the direction that is worse* (``worse_when``): a longer recovery,
more failures, requeues, restarts, lost steps or idle GPU time, a lower
availability. A figure better than the range, a latency, the length of one
of the suite's own steps (a clause's duration and phases), and one whose
name says no direction (requests sent, steps run, a configured bound) are
printed, never judged. Ranges come from repeated runs (``ranges_from``):
without them a figure's change is printed but not judged, since one run's
noise is unknown.
"""
from __future__ import annotations

import copy
import json
import math
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from reports import bundle
from reports.summary import ERROR, FAIL, NOT_APPLICABLE, PASS

MISSING = "not run"
_RANK = {PASS: 0, NOT_APPLICABLE: 1, MISSING: 2, FAIL: 3, ERROR: 4}
DEFAULT_SLACK = 0.10  # of the observed range's magnitude, beyond its ends


class CertificateError(ValueError):
    """Not a certification this command can read, or a bundle that does not verify."""


@dataclass
class Change:
    clause: str
    what: str  # "outcome" or a figure's name
    old: Any
    new: Any
    regression: str = ""  # why it is one; empty when it is not

    def line(self) -> str:
        change = ""
        if isinstance(self.old, (int, float)) and isinstance(self.new, (int, float)):
            delta = self.new - self.old
            change = f" ({delta:+.6g}" + (f", {delta / abs(self.old):+.1%})" if self.old else ")")
        flag = f"  REGRESSION: {self.regression}" if self.regression else ""
        return f"{self.clause:<8} {self.what}: {self.old} -> {self.new}{change}{flag}"


@dataclass
class Comparison:
    old_verdict: str
    new_verdict: str
    changes: list[Change] = field(default_factory=list)
    judged_figures: bool = False
    unchanged: int = 0  # figures equal in both runs (and inside their range)

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regression]


def load(path: Path) -> dict[str, Any]:
    """The certificate (``certification.json``'s content) of a bundle, a report directory or the file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "certification.json"
    if not path.is_file():
        raise CertificateError(f"{path} does not exist (pass a certification bundle, report directory or "
                               "certification.json)")
    if tarfile.is_tarfile(path):
        try:
            problems, summary = bundle.verify(path)
        except bundle.BundleError as exc:
            raise CertificateError(str(exc)) from None
        if problems:
            raise CertificateError(f"{path} does not verify ({problems[0]}); `bin/rayproof verify {path}` lists "
                                   "every problem")
        return summary
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CertificateError(f"{path} is not a certification.json: {exc}") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("clauses"), list):
        raise CertificateError(f"{path} is not a certification.json: it lists no clauses")
    return summary


# Evidence keys that hold a wall-clock time (seconds since the epoch), not a
# figure: they differ between any two runs and say nothing by themselves.
_WALL_CLOCK = {"at", "ts", "start", "end", "started", "finished", "last_finished"}
# Evidence keys that measure the suite's own queueing on its host, not the
# platform (how long a clause waited for a host slot).
_SUITE_ONLY = {"waited_for_host_slot_s"}


# A key that is a name Kubernetes generated (``generateName``: five
# characters of k8s.io/apimachinery's rand alphabet, no vowels or 0, 1, 3),
# such as a pod of a RayCluster or a Job. Every run has other ones, so such
# keys become ``*`` and their figures are combined into the worst of them
# (the slowest pod's start, the most restarts of any of team B's pods).
_GENERATED_NAME = re.compile(r"-[bcdfghjklmnpqrstvwxz2456789]{5}$")
ANY_GENERATED = "*"


def figures(clause: dict[str, Any]) -> dict[str, float]:
    """Every number in a clause's evidence, by dotted key, and its duration
    (wall-clock instants and the suite's own queueing left out); figures of
    objects with generated names are combined under ``*``, worst first."""
    found: dict[str, float] = {"duration_s": float(clause.get("duration_s") or 0.0)}

    def walk(prefix: str, value: Any) -> None:
        last = prefix.rsplit(".", 1)[-1]
        if isinstance(value, bool) or last in _WALL_CLOCK or last in _SUITE_ONLY or last.endswith("_at"):
            return
        if isinstance(value, (int, float)) and math.isfinite(value):
            if prefix in found and ANY_GENERATED in prefix.split("."):
                worst = min if worse_when(prefix) == LOWER_IS_WORSE else max
                found[prefix] = worst(found[prefix], float(value))
            else:
                found[prefix] = float(value)
        elif isinstance(value, dict):
            for key, inner in value.items():
                key = ANY_GENERATED if _GENERATED_NAME.search(str(key)) else str(key)
                walk(f"{prefix}.{key}" if prefix else key, inner)

    walk("", clause.get("evidence") or {})
    return found


# Which way a figure gets worse, read from its name. Times are in seconds
# (``_s``, ``seconds...``, or under a ``..._s`` mapping such as
# ``recovery_steps_s``); the rest are named here. Left unjudged: the lengths
# of the suite's own steps, a clause's ``duration_s`` (it holds the suite's
# waits for a share of the platform), its ``phases_s`` and its chaostoolkit
# ``experiment.duration_s`` (they hold the suite's waits for the workload to
# reach the point of the fault, which is the machine's speed: TRN-1's inject
# phase was 20.7 and 25 s in two reference runs and 43.5 s in a third, with
# nothing changed), and latencies (``_ms``): per-second p99s on the
# reference machine moved tenfold between runs with nothing changed (GCS-1's
# baseline p99: 36 and 59 ms in the shipped ranges' two runs, 1042 ms in a
# third, 2026-12-04), so no tolerance from a few runs holds for them, and the
# serving promise the clauses judge is availability.
HIGHER_IS_WORSE, LOWER_IS_WORSE = "higher", "lower"
_WORSE_WHEN_HIGHER = {"failed", "requeues", "a_requeues", "requeue_count", "restarts", "steps_lost",
                      "rayjob_failed_attempts", "dead", "gpu_hours", "gpu_seconds", "amount"}
_WORSE_WHEN_LOWER = {"availability", "min_alive_during_event"}
_SUITE_STEPS = {"duration_s", "experiment.duration_s"}
# Parts of a name that mark a configured value or a promise, not a measurement.
_CONFIGURED = ("promised", "bound", "timeout", "target", "price", "port", "interval", "ttlseconds")


def worse_when(name: str) -> str:
    """``HIGHER_IS_WORSE``, ``LOWER_IS_WORSE``, or "" for a figure that is not judged."""
    parts = name.lower().split(".")
    last = parts[-1]
    if name in _SUITE_STEPS or parts[0] == "phases_s" or last.endswith("_ms") \
            or any(word in last for word in _CONFIGURED):
        return ""
    if last in _WORSE_WHEN_LOWER:
        return LOWER_IS_WORSE
    if (last in _WORSE_WHEN_HIGHER or last.endswith("_s") or last.startswith("seconds")
            or any(part.endswith("_s") for part in parts[:-1])):
        return HIGHER_IS_WORSE
    return ""


def compare(old: dict[str, Any], new: dict[str, Any], ranges: dict[str, Any] | None = None) -> Comparison:
    result = Comparison(old["verdict"], new["verdict"], judged_figures=ranges is not None)
    old_clauses = {c["id"]: c for c in old["clauses"]}
    new_clauses = {c["id"]: c for c in new["clauses"]}
    slack = float((ranges or {}).get("slack", DEFAULT_SLACK))
    for cid in sorted(set(old_clauses) | set(new_clauses)):
        before = old_clauses.get(cid, {}).get("outcome", MISSING)
        after = new_clauses.get(cid, {}).get("outcome", MISSING)
        if before != after:
            worse = _RANK.get(after, 4) > _RANK.get(before, 4)
            result.changes.append(Change(cid, "outcome", before, after, "the outcome got worse" if worse else ""))
        if cid not in old_clauses or cid not in new_clauses:
            continue
        old_figures, new_figures = figures(old_clauses[cid]), figures(new_clauses[cid])
        known = ((ranges or {}).get("clauses") or {}).get(cid) or {}
        for name in sorted(set(old_figures) & set(new_figures)):
            value = new_figures[name]
            why = _worse_than_range(known.get(name), value, slack, name)
            if value == old_figures[name] and not why:
                result.unchanged += 1
                continue
            result.changes.append(Change(cid, name, old_figures[name], value, why))
    return result


def _worse_than_range(span: dict[str, Any] | None, value: float, slack: float, name: str) -> str:
    worse = worse_when(name)
    if not span or not worse:
        return ""
    low, high = float(span["min"]), float(span["max"])
    # The slack is a share of the figure's size, or of the range where wider;
    # for an availability, of its unavailability (10% of 1.0 would let 0.999
    # fall to 0.9 unflagged).
    size = 1.0 - low if name.rsplit(".", 1)[-1] == "availability" else max(abs(low), abs(high))
    margin = slack * max(size, high - low)
    of = f"the reference range [{low:g}, {high:g}] of {span.get('runs', '?')} runs"
    if worse == HIGHER_IS_WORSE and value > high + margin:
        return f"above {of} (slack {slack:.0%}: at most {high + margin:g})"
    if worse == LOWER_IS_WORSE and value < low - margin:
        return f"below {of} (slack {slack:.0%}: at least {low - margin:g})"
    return ""


def ranges_from(certificates: list[dict[str, Any]], slack: float = DEFAULT_SLACK,
                onto: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per clause and figure, the lowest and highest value of the passed runs
    of each clause (a failed run's figures say nothing of healthy noise), and
    which runs they came from; ``onto``, a ranges file made earlier, is
    widened by these runs and keeps its sources. Raises CertificateError for
    runs of platforms at different versions (their spread would not be one
    platform's noise) and for a run counted twice."""
    earlier = list((onto or {}).get("sources") or [])
    platforms = {_canonical(source.get("versions")) for source in earlier}
    platforms |= {_canonical((c.get("platform") or {}).get("versions")) for c in certificates}
    if len(platforms) > 1:
        raise CertificateError("these certifications are of platforms at different versions "
                               f"({'; '.join(sorted(platforms))}): a range is the noise of one platform")
    counted = {(source.get("started"), source.get("cluster")) for source in earlier}
    for certificate in certificates:
        run = (certificate.get("started"), (certificate.get("platform") or {}).get("cluster"))
        if run[0] is not None and run in counted:
            raise CertificateError(f"the run started at {run[0]} is given twice or is in these ranges already: "
                                   "a run counts once")
        counted.add(run)
    clauses: dict[str, dict[str, dict[str, Any]]] = copy.deepcopy((onto or {}).get("clauses") or {})
    for certificate in certificates:
        for clause in certificate["clauses"]:
            if clause.get("outcome") != PASS:
                continue
            for name, value in figures(clause).items():
                span = clauses.setdefault(clause["id"], {}).setdefault(name, {"min": value, "max": value, "runs": 0})
                span["min"], span["max"] = min(span["min"], value), max(span["max"], value)
                span["runs"] += 1
    sources = earlier + [{"verdict": c["verdict"], "started": c.get("started"), "wall_s": c.get("wall_s"),
                          **{k: (c.get("platform") or {}).get(k) for k in ("cluster", "versions", "nodes", "machine")}}
                         for c in certificates]
    return {"runs": len(sources), "slack": slack, "sources": sources, "clauses": clauses}


def _canonical(versions: Any) -> str:
    return json.dumps(versions, sort_keys=True, default=str)


def load_ranges(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CertificateError(f"cannot read ranges file {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("clauses"), dict):
        raise CertificateError(f"{path} is not a ranges file (it has no 'clauses' mapping); "
                               "make one with `bin/rayproof ranges CERTIFICATION...`")
    return data


def to_text(result: Comparison) -> str:
    lines = [f"verdict: {result.old_verdict} -> {result.new_verdict}"]
    lines += [change.line() for change in result.changes]
    lines.append(f"{result.unchanged} figure{'s' if result.unchanged != 1 else ''} the same in both runs")
    if not result.judged_figures:
        lines.append("figures not judged: no ranges file (pass --ranges, made by `bin/rayproof ranges` from "
                     "repeated runs); only outcome changes count as regressions")
    regressions = result.regressions
    lines.append(f"{len(regressions)} regression{'s' if len(regressions) != 1 else ''}"
                 + (": " + ", ".join(sorted({f'{c.clause} {c.what}' for c in regressions})) if regressions else ""))
    return "\n".join(lines)
