"""The certification summary, in Markdown and machine-readable JSON.

Built only from the results file the pytest plugin writes
(``--rayproof-results``) plus a description of the platform, so it can be
regenerated later without a cluster: ``rayproof report RESULTS.json``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PASS, FAIL, NOT_APPLICABLE, ERROR = "pass", "fail", "not applicable", "error"
_OUTCOMES = {"passed": PASS, "failed": FAIL, "not_applicable": NOT_APPLICABLE, "error": ERROR, "skipped": ERROR}


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
    ordered = sorted(clauses.values(), key=lambda c: c["id"])
    counts = {k: sum(1 for c in ordered if c["outcome"] == k) for k in (PASS, FAIL, NOT_APPLICABLE, ERROR)}
    certified = bool(ordered) and counts[FAIL] == 0 and counts[ERROR] == 0
    return {
        "verdict": "CERTIFIED" if certified else "NOT CERTIFIED",
        "counts": counts,
        "platform": platform,
        "started": results.get("started"),
        "finished": results.get("finished"),
        "wall_s": round((results.get("finished") or 0) - (results.get("started") or 0), 1),
        "host": results.get("host"),
        "clauses": ordered,
    }


def to_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# rayproof certification: {summary['verdict']}", ""]
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
    (out_dir / "certification.json").write_text(json.dumps(summary, indent=2, default=str))
    (out_dir / "certification.md").write_text(to_markdown(summary))
    return summary
