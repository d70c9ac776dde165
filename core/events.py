"""The JSON event lines the workloads print, parsed: shared by the faults
(which wait on a rank's events) and by the clauses that read them.

Workloads print ``RAYPROOF_EVENT {json}`` lines; Ray may prefix them (worker
output is forwarded to the driver as ``(RayTrainWorker pid=...) ...``), so the
marker is searched anywhere in a line.
"""
from __future__ import annotations

import json
from typing import Any

MARKER = "RAYPROOF_EVENT"


def parse_events(text: str) -> list[dict[str, Any]]:
    """Events in order of appearance; a line forwarded twice by Ray counts once."""
    events = []
    seen: set[str] = set()
    for line in text.splitlines():
        _, found, payload = line.partition(MARKER)
        if not found:
            continue
        payload = payload.strip()
        if payload in seen:
            continue
        seen.add(payload)
        try:
            record = json.loads(payload)
        except json.JSONDecodeError:
            continue  # a line cut by a crash; the ones before it still count
        if isinstance(record, dict) and "event" in record:
            events.append(record)
    return events
