"""The certification summary, in Markdown and machine-readable JSON.

Built only from the results file the pytest plugin writes
(``--rayproof-results``) plus a description of the platform, so it can be
regenerated later without a cluster: ``rayproof report RESULTS.json``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core import cost
from reports import html_page

PASS, FAIL, NOT_APPLICABLE, ERROR = "pass", "fail", "not applicable", "error"
_OUTCOMES = {"passed": PASS, "failed": FAIL, "not_applicable": NOT_APPLICABLE, "error": ERROR, "skipped": ERROR}

# The verdicts. Only CERTIFIED speaks for the whole platform: every clause of
# the catalogue run to completion, none failed, pytest's exit 0, and the
# suite's own bounds at their defaults. The others say what the run was.
CERTIFIED, NOT_CERTIFIED = "CERTIFIED", "NOT CERTIFIED"
PARTIAL, INCOMPLETE, NON_DEFAULT = "PARTIAL", "INCOMPLETE", "NON-DEFAULT"
# pytest's exit statuses that mean the run did not finish (interrupted,
# internal error, usage error, nothing collected).
_UNFINISHED = {2: "was interrupted", 3: "ended in an internal error", 4: "was refused (usage error or preflight)",
               5: "collected no clause"}


def build(results: dict[str, Any], platform: dict[str, Any]) -> dict[str, Any]:
    clauses: dict[str, dict[str, Any]] = {}
    for r in results["results"]:
        cid = r.get("clause")
        if not cid:
            continue
        outcome = _OUTCOMES.get(r["outcome"], ERROR)
        entry = clauses.setdefault(cid, {"id": cid, "must": r.get("must") or "", "outcome": PASS,
                                         "duration_s": 0.0, "evidence": {}, "message": "", "test": r["nodeid"]})
        entry["duration_s"] = round(entry["duration_s"] + r.get("duration_s", 0.0), 2)
        entry["evidence"].update(r.get("evidence") or {})
        # The worst phase decides: an error in teardown spoils a passed call.
        rank = [PASS, NOT_APPLICABLE, FAIL, ERROR]
        if rank.index(outcome) > rank.index(entry["outcome"]):
            entry["outcome"] = outcome
            entry["message"] = r.get("message") or ""
            entry["not_run"] = bool(r.get("not_run"))  # errored waiting for the machine or the cluster: not judged
    ordered = sorted(clauses.values(), key=lambda c: c["id"])
    counts = {k: sum(1 for c in ordered if c["outcome"] == k) for k in (PASS, FAIL, NOT_APPLICABLE, ERROR)}
    verdict, why = judge(results, ordered)
    return {
        "verdict": verdict,
        "verdict_reason": why,
        "counts": counts,
        "cost_per_incident": cost.per_incident(ordered),
        "bounds": {"timeout_overrides": results.get("timeout_overrides") or {},
                   "profile_outside_ranges": results.get("profile_outside_ranges") or []},
        "platform": platform,
        # Promises the clauses could not read from the cluster and judged as the profile states them.
        "taken_on_trust": sorted({p for c in ordered for p in (c["evidence"].get("promises_taken_on_trust") or [])}),
        "started": results.get("started"),
        "finished": results.get("finished"),
        "wall_s": round((results.get("finished") or 0) - (results.get("started") or 0), 1),
        "host": results.get("host"),
        "clauses": ordered,
    }


def judge(results: dict[str, Any], clauses: list[dict[str, Any]]) -> tuple[str, str]:
    """The verdict and one sentence saying why."""
    exit_status = results.get("exit_status")
    catalogue = results.get("catalogue")
    if exit_status in _UNFINISHED:
        return INCOMPLETE, f"the run {_UNFINISHED[exit_status]} (pytest exit status {exit_status})"
    if catalogue is None:
        return INCOMPLETE, "the results do not list the clause catalogue, so a complete run cannot be told apart"
    ran = {c["id"] for c in clauses}
    missing = [cid for cid in catalogue if cid not in ran]
    of = f"{len(catalogue) - len(missing)} of {len(catalogue)} clauses run"
    failed = [c["id"] for c in clauses if c["outcome"] == FAIL or (c["outcome"] == ERROR and not c.get("not_run"))]
    if failed:
        return NOT_CERTIFIED, f"{', '.join(failed)} did not pass" + (f" ({of})" if missing else "")
    not_run = [c["id"] for c in clauses if c["outcome"] == ERROR and c.get("not_run")]
    if not_run:
        return INCOMPLETE, (f"{', '.join(not_run)} could not start: the shares of this machine or of the cluster "
                            "they wait for stayed held by other work for cluster_share, so they were not judged")
    unjudged = contradicted_not_applicable(clauses)
    if unjudged:
        return INCOMPLETE, "; ".join(unjudged)
    if missing:
        return PARTIAL, f"{of}; not run: {', '.join(missing)}"
    if exit_status != 0:
        return INCOMPLETE, f"every clause passed but pytest ended with exit status {exit_status}"
    overrides = results.get("timeout_overrides") or {}
    if overrides:
        return NON_DEFAULT, f"every clause passed with the suite's bounds changed: {', '.join(sorted(overrides))}"
    return CERTIFIED, f"all {len(catalogue)} clauses run to completion and passed with default bounds"


def contradicted_not_applicable(clauses: list[dict[str, Any]]) -> list[str]:
    """Clauses called not applicable on a NetworkPolicy probe (no
    enforcement) that the run's own evidence contradicts: another clause saw
    NetworkPolicy enforced, or the clauses cite different probes. Such a
    clause was never judged, so the run cannot certify."""
    probes = {}
    for c in clauses:
        for key in ("network_policy_enforcement", "probe"):
            seen = (c.get("evidence") or {}).get(key)
            if isinstance(seen, dict) and "enforced" in seen:
                probes[c["id"]] = seen
    ids = sorted({str(p.get("probe_id")) for p in probes.values()})
    enforced = sorted({bool(p["enforced"]) for p in probes.values()})
    if len(enforced) < 2 and len(ids) < 2:
        return []
    return [f"{c['id']} was called not applicable for a cluster that does not enforce NetworkPolicy, which the run's "
            f"own evidence contradicts (probes {', '.join(ids)}; enforced {enforced}): it was not judged"
            for c in clauses if c["outcome"] == NOT_APPLICABLE and c["id"] in probes]


def to_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# rayproof certification: {summary['verdict']}", "", f"{summary['verdict_reason']}.", ""]
    bounds = summary.get("bounds") or {}
    if bounds.get("timeout_overrides"):
        lines += ["**The suite's bounds were changed for this run:** "
                  + ", ".join(f"`{k}={v}`" for k, v in sorted(bounds["timeout_overrides"].items())), ""]
    if bounds.get("profile_outside_ranges"):
        lines += ["**Promises outside the ranges the design calls sane** (the clauses judged the platform against "
                  "them):", "", *[f"- {line}" for line in bounds["profile_outside_ranges"]], ""]
    if summary.get("taken_on_trust"):
        lines += ["**Promises taken on trust** (the cluster did not let the suite read them; the clauses judged the "
                  "platform against the profile's word):", "", *[f"- {p}" for p in summary["taken_on_trust"]], ""]
    spent = summary.get("cost_per_incident") or {}
    if spent.get("incidents"):
        lines += [f"**{cost.HEADLINE}** {cost.total(spent)}", "",
                  "| clause | GPU time held without progress | GPU-hours | cost |", "| --- | --- | --- | --- |"]
        lines += [f"| {i['clause']} | {i['what']} | {i['gpu_hours']:g} | {i['amount']:.2f} {i['currency']} "
                  f"(at {i['gpu_hour_price']:g} per GPU-hour) |" for i in spent["incidents"]]
        lines.append("")
    platform = summary["platform"]
    lines += ["| platform | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in platform.items()]
    c = summary["counts"]
    lines += ["", f"{c[PASS]} passed, {c[FAIL]} failed, {c[NOT_APPLICABLE]} not applicable, {c[ERROR]} errors; "
                  f"wall time {summary['wall_s']} s on {summary['host']}.", ""]
    lines += ["| clause | outcome | seconds | MUST |", "| --- | --- | --- | --- |"]
    for cl in summary["clauses"]:
        lines.append(f"| {cl['id']} | {cl['outcome']} | {cl['duration_s']} | {cl['must']} |")
    lines.append("")
    for cl in summary["clauses"]:
        lines += [f"## {cl['id']}: {cl['outcome']}", "", cl["must"], ""]
        if cl["message"]:
            lines += ["```", cl["message"].strip()[:3000], "```", ""]
        if cl["evidence"]:
            lines += ["| evidence | value |", "| --- | --- |"]
            lines += [f"| {k} | `{_cell(v)}` |" for k, v in sorted(cl["evidence"].items())]
            lines.append("")
    return "\n".join(lines)


def _cell(value: Any, limit: int = 600) -> str:
    """An evidence value for a Markdown table cell (long ones are cut; the JSON has them whole)."""
    text = json.dumps(value, default=str).replace("|", "\\|").replace("`", "'")
    return text if len(text) <= limit else text[:limit] + " ... (full value in certification.json)"


def write(results_path: Path, platform: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    results = json.loads(Path(results_path).read_text())
    summary = build(results, platform)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in zip(CERTIFICATE_FILES, render(summary)):
        (out_dir / name).write_text(text)
    return summary


CERTIFICATE_FILES = ("certification.json", "certification.md", "certification.html")


def render(summary: dict[str, Any]) -> tuple[str, str, str]:
    """The certificate's files (CERTIFICATE_FILES), as text."""
    return json.dumps(summary, indent=2, default=str), to_markdown(summary), html_page.to_html(summary)
