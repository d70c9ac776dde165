"""The certificate as one self-contained HTML page (no external files, scripts
or fonts): verdict and cost at the top, then a row per clause with its MUST,
outcome, key figures and timeline, its evidence expandable."""
from __future__ import annotations

import base64
import json
from html import escape
from typing import Any

from core import cost
from reports import timeline

_COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "error": "#cf222e", "not applicable": "#6e7781"}
_VERDICT_COLOURS = {"CERTIFIED": "#1a7f37", "NOT CERTIFIED": "#cf222e"}
_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1f2328}
h1 .verdict{padding:.1em .4em;border-radius:.2em;color:#fff}
table{border-collapse:collapse;width:100%;margin:1em 0}td,th{border:1px solid #d0d7de;padding:.35em .5em;
vertical-align:top;text-align:left;font-size:.9em}.outcome{font-weight:bold}.must{max-width:480px}
td.timeline{min-width:460px}img.timeline{width:460px;border:1px solid #d0d7de}pre{white-space:pre-wrap;font-size:.8em;background:#f6f8fa;
padding:.5em}summary{cursor:pointer}
"""


def _figures(clause: dict[str, Any], drawn: timeline.Timeline | None, limit: int = 6) -> str:
    """A clause's headline numbers: its timeline's marks where it has one, else
    its top-level numeric evidence (at most ``limit``); its cost where measured."""
    evidence = clause["evidence"]
    if drawn is not None:
        shown = [(f"{label} (s)", seconds) for label, seconds in drawn.marks]
    else:
        shown = [(k, v) for k, v in sorted(evidence.items())
                 if isinstance(v, (int, float)) and not isinstance(v, bool)][:limit]
    lines = [f"{escape(k)}: {v:g}" for k, v in shown]
    spent = evidence.get(cost.EVIDENCE_KEY)
    if isinstance(spent, dict) and "gpu_hours" in spent:
        lines.append(f"idle GPU-hours: {spent['gpu_hours']:g} ({spent['amount']:.2f} {escape(spent['currency'])})")
    return "<br>".join(lines)


def _timeline_img(clause: dict[str, Any], drawn: timeline.Timeline | None) -> str:
    if drawn is None:
        return ""
    data = base64.b64encode(timeline.png(drawn)).decode()
    return (f'<img class="timeline" alt="{escape(clause["id"])} timeline" '
            f'data-marks="{escape(json.dumps(dict(drawn.marks)))}" src="data:image/png;base64,{data}">')


def to_html(summary: dict[str, Any]) -> str:
    verdict = summary["verdict"]
    colour = _VERDICT_COLOURS.get(verdict, "#9a6700")
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>rayproof certification: "
             f"{escape(verdict)}</title><style>{_STYLE}</style></head><body>",
             f'<h1>rayproof certification: <span class="verdict" id="verdict" style="background:{colour}">'
             f"{escape(verdict)}</span></h1><p>{escape(summary['verdict_reason'])}.</p>"]
    spent = summary.get("cost_per_incident") or {}
    if spent.get("incidents"):
        parts.append(f"<p><b>{escape(cost.HEADLINE)}</b> {escape(cost.total(spent))}</p><table><tr><th>clause</th>"
                     "<th>GPU time held without progress</th><th>GPU-hours</th><th>cost</th></tr>")
        parts += [f"<tr><td>{escape(i['clause'])}</td><td>{escape(i['what'])}</td><td>{i['gpu_hours']:g}</td>"
                  f"<td>{i['amount']:.2f} {escape(i['currency'])}</td></tr>" for i in spent["incidents"]]
        parts.append("</table>")
    c = summary["counts"]
    parts.append(f"<p>{c['pass']} passed, {c['fail']} failed, {c['not applicable']} not applicable, {c['error']} "
                 f"errors; wall time {summary['wall_s']} s on {escape(str(summary['host']))}.</p>")
    parts.append("<table><tr><th>clause</th><th>MUST</th><th>outcome</th><th>key figures</th><th>timeline</th></tr>")
    for cl in summary["clauses"]:
        drawn = timeline.of(cl)
        parts.append(f'<tr id="{escape(cl["id"])}"><td>{escape(cl["id"])}</td><td class="must">{escape(cl["must"])}'
                     f'</td><td class="outcome" style="color:{_COLOURS.get(cl["outcome"], "#1f2328")}">'
                     f"{escape(cl['outcome'])}<br>{cl['duration_s']} s</td><td>{_figures(cl, drawn)}</td>"
                     f'<td class="timeline">{_timeline_img(cl, drawn)}</td></tr>')
        details = (f"<pre>{escape(cl['message'].strip()[:3000])}</pre>" if cl["message"] else "") + \
            f"<pre>{escape(json.dumps(cl['evidence'], indent=1, sort_keys=True, default=str))}</pre>"
        parts.append(f'<tr><td colspan=5><details><summary>{escape(cl["id"])} evidence</summary>{details}'
                     "</details></td></tr>")
    parts.append("</table><table><tr><th>platform</th><th></th></tr>")
    parts += [f"<tr><td>{escape(str(k))}</td><td>{escape(str(v))}</td></tr>" for k, v in summary["platform"].items()]
    parts.append("</table></body></html>\n")
    return "".join(parts)
