"""Training RayJobs as the clauses submit them, and reading what they did.

Shared by the Kubernetes clauses: a training RayJob of the profile's shape
(one Ray Train worker per worker pod), submitted through Kueue, and the
``RAYPROOF_EVENT`` lines of its driver read back from the submitter pod's log.
"""
from __future__ import annotations

from typing import Any

from fixtures import manifests as mf
from fixtures.events import parse_events


def training_rayjob(lab: Any, name: str, *, workers: int = 2, steps: int = 12, step_time_s: float = 0.0,
                    max_failures: int = 0, queue: str | None = "team", priority_class: str | None = None,
                    backoff_limit: int = 0, timeout_s: float | None = None, run_name: str | None = None,
                    checkpoint_every: int | None = None) -> dict[str, Any]:
    profile = lab.profile
    entry = mf.training_entrypoint(profile, run_name or name, world_size=workers, steps=steps, step_time_s=step_time_s,
                                   max_failures=max_failures, timeout_s=timeout_s, checkpoint_every=checkpoint_every)
    spec = mf.raycluster_spec(profile, lab.labels, workers=workers)
    return mf.rayjob(name, lab.labels, entry, spec, queue=queue, priority_class=priority_class,
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
