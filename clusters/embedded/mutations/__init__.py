"""The mutation catalogue: one-change broken versions of the reference platform.

A certificate is worth what it can refuse. Each entry of ``catalogue.yaml``
(beside this file) is one change of the kind a platform team makes, the
clauses it must fail and, per clause, the words the failure message must
contain (its cause). ``bin/rayproof bench mutants`` runs every entry;
the self-tests (``tests/selftest/``) run the entries marked ``selftest``.

A change is one of:

``template``
    a golden template (``rayJob``, ``rayCluster``, ``rayService``) with
    ``edits`` made to a copy, which the certification profile points at.
``onboarding``
    an onboarding class that is the reference ``standard`` one with ``edits``
    made to its objects, installed beside it as the platform's operators
    would, which the profile's ``teams.namespaceLabels`` names.
``platform``
    the embedded platform's own profile (a Kueue, KubeRay or network
    setting), merged over the run's; it needs a platform of its own.
``profile``
    the certification profile (a pointer to another platform object),
    merged over the run's. Beside ``platform`` it describes that platform
    as it is (a ``waitForPodsReady`` that is shorter, say), the way its
    team writes the profile it certifies with.

An edit names a path and what to do there: ``set`` (with ``value``),
``append`` (``value`` added at the end of the list there), ``remove``, or,
for onboarding objects, ``delete`` (the whole object). A path
is dotted keys; ``cluster`` as its first part is the Ray cluster spec inside
the object (a RayJob's ``rayClusterSpec``, a RayService's
``rayClusterConfig``); a list is entered with ``[*]`` (every item),
``[N]`` (item N, from 0) or ``[name=X]`` (the items whose ``name`` is X). An edit that matches nothing
is an error: a catalogue that no longer fits its platform says so instead of
running the unchanged platform under a mutation's name.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from core.catalogue import catalogue as clause_catalogue
from core.profile import cluster_spec_in

HERE = Path(__file__).resolve().parent
CATALOGUE = HERE / "catalogue.yaml"
EMBEDDED = HERE.parent
GOLDEN = EMBEDDED / "golden"
STANDARD_ONBOARDING = EMBEDDED / "onboarding" / "standard.yaml"
TEMPLATE_FILES = {"rayJob": "rayjob.yaml", "rayCluster": "raycluster.yaml", "rayService": "rayservice.yaml"}
KINDS = ("template", "onboarding", "platform", "profile")
_STEP = re.compile(r"^(?P<key>[A-Za-z0-9_.\-/]+?)?(?:\[(?P<sel>\*|\d+|name=[^\]]+)\])?$")


class CatalogueError(ValueError):
    """The catalogue (or an entry's edit) does not fit the reference platform."""


@dataclass(frozen=True)
class Mutation:
    """One entry: a change to the reference platform and the clauses it must fail."""

    id: str
    kind: str
    summary: str
    expect: dict[str, tuple[str, ...]]  # clause id -> words, any one of which the failure names
    change: dict[str, Any]
    source: str = ""
    selftest: tuple[str, ...] = ()  # the clauses whose self-test this entry is
    bounds: dict[str, float] = field(default_factory=dict)  # timeout tiers a broken platform waits out in full

    @property
    def clauses(self) -> list[str]:
        return sorted(self.expect)

    def digest(self) -> str:
        """SHA-256 of what the entry changes and expects: a kill measured
        under another version of the entry is not this entry's."""
        what = {"kind": self.kind, "change": self.change, "expect": self.expect, "bounds": self.bounds}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=list).encode()).hexdigest()

    def needs_own_platform(self) -> bool:
        return self.kind == "platform"

    def platform_profile(self) -> dict[str, Any]:
        """What the entry merges over the embedded platform's profile ({} for none)."""
        return copy.deepcopy(self.change["platform"]) if self.kind == "platform" else {}

    def profile(self) -> dict[str, Any]:
        """What the entry merges over the certification profile, before any template or class it makes."""
        return copy.deepcopy(self.change.get("profile") or {})

    def template(self) -> tuple[str, dict[str, Any]]:
        """The golden template it changes and the changed copy (``template`` entries)."""
        name = self.change["template"]
        obj = yaml.safe_load((GOLDEN / TEMPLATE_FILES[name]).read_text())
        for edit in self.change["edits"]:
            apply_edit(obj, edit, what=f"{self.id}: golden {name}")
        return name, obj

    def onboarding_class(self) -> list[dict[str, Any]]:
        """The reference onboarding class's objects with the entry's edits made (``onboarding`` entries)."""
        docs = [d for d in yaml.safe_load_all(STANDARD_ONBOARDING.read_text()) if d]
        for edit in self.change["edits"]:
            targets = [d for d in docs if d["kind"] == edit["object"]["kind"]
                       and edit["object"].get("name") in (None, d["metadata"]["name"])]
            if not targets:
                raise CatalogueError(f"{self.id}: the reference onboarding class has no {edit['object']}")
            if edit.get("delete"):
                docs = [d for d in docs if not any(d is t for t in targets)]
                continue
            for doc in targets:
                apply_edit(doc, edit, what=f"{self.id}: onboarding {edit['object']}")
        return docs


_PART = re.compile(r"(?:[^.\[]|\[[^\]]*\])+")  # dots inside [name=...] do not split


def _steps(path: str) -> list[tuple[str | None, str | None]]:
    steps = []
    for part in _PART.findall(path):
        m = _STEP.match(part)
        if not m or not (m["key"] or m["sel"]):
            raise CatalogueError(f"bad path {path!r} at {part!r}")
        steps.append((m["key"], m["sel"]))
    return steps


def _select(node: Any, key: str | None, sel: str | None) -> Iterator[tuple[Any, Any]]:
    """(container, key) pairs a path step reaches from ``node``."""
    if key is not None:
        if not isinstance(node, dict):
            return
        if sel is None:
            yield node, key
            return
        node = node.get(key)
    if not isinstance(node, list):
        return
    for i, item in enumerate(node):
        if sel in ("*", str(i)) or (isinstance(item, dict) and sel == f"name={item.get('name')}"):
            yield node, i


def _places(obj: dict[str, Any], path: str, *, make: bool) -> list[tuple[Any, Any]]:
    steps = _steps(path)
    roots: list[Any] = [obj]
    if steps[0] == ("cluster", None):
        roots, steps = [cluster_spec_in(obj)], steps[1:]
    places: list[tuple[Any, Any]] = []
    for i, (key, sel) in enumerate(steps):
        places = [p for root in roots for p in _select(root, key, sel)]
        if i < len(steps) - 1:
            roots = []
            for container, k in places:
                if isinstance(container, dict) and k not in container:
                    if not make:
                        continue  # `remove` goes nowhere a map is missing
                    container[k] = {}  # `set` makes the maps its path goes through
                roots.append(container[k])
    return places


def apply_edit(obj: dict[str, Any], edit: dict[str, Any], *, what: str) -> None:
    """Make one ``set``/``append``/``remove`` edit in ``obj``; an edit that matches nothing is an error."""
    if "append" in edit:
        path = edit["append"]
        places = [(c, k) for c, k in _places(obj, path, make=False)
                  if isinstance(c, (dict, list)) and (isinstance(c, list) or k in c) and isinstance(c[k], list)]
        for container, key in places:
            container[key].append(copy.deepcopy(edit["value"]))
    elif "set" in edit:
        places = _places(obj, edit["set"], make=True)
        for container, key in places:
            container[key] = copy.deepcopy(edit["value"])
        path = edit["set"]
    elif "remove" in edit:
        path = edit["remove"]
        places = [(c, k) for c, k in _places(obj, path, make=False)
                  if (isinstance(c, dict) and k in c) or isinstance(c, list)]
        for container, key in sorted(places, key=lambda p: p[1] if isinstance(p[1], int) else 0, reverse=True):
            del container[key]
    else:
        raise CatalogueError(f"{what}: an edit needs set, append, remove or delete: {edit}")
    if not places:
        raise CatalogueError(f"{what}: {path} matches nothing")


def _mutation(raw: dict[str, Any], clauses: set[str]) -> Mutation:
    ident = raw.get("id") or "?"
    kinds = [k for k in KINDS[:3] if k in raw.get("change", {})] or [k for k in KINDS[3:] if k in raw.get("change", {})]
    if len(kinds) != 1 or (kinds[0] != "platform" and len(raw["change"]) - ("edits" in raw["change"]) != 1):
        raise CatalogueError(f"{ident}: change must be one of {', '.join(KINDS)} (a profile may go with a "
                             f"platform change), got {sorted(raw.get('change', {}))}")
    expect = {c: tuple([w] if isinstance(w, str) else w) for c, w in (raw.get("expect") or {}).items()}
    unknown = sorted(set(expect) - clauses)
    if not expect or unknown:
        raise CatalogueError(f"{ident}: expect must name clauses of the catalogue (unknown: {unknown or 'none given'})")
    selftest = tuple(raw.get("selftest") or ())
    if set(selftest) - set(expect):
        raise CatalogueError(f"{ident}: selftest names clauses it does not expect to fail: {selftest}")
    change = raw["change"]
    if kinds[0] == "template" and change["template"] not in TEMPLATE_FILES:
        raise CatalogueError(f"{ident}: unknown template {change['template']!r} (one of {sorted(TEMPLATE_FILES)})")
    return Mutation(id=ident, kind=kinds[0], summary=" ".join(str(raw.get("summary", "")).split()), expect=expect,
                    change=change, source=" ".join(str(raw.get("source", "")).split()), selftest=selftest,
                    bounds={str(k): float(v) for k, v in (raw.get("bounds") or {}).items()})


def load(path: Path = CATALOGUE) -> list[Mutation]:
    """Every entry of the catalogue, checked: unique ids, known clauses, each change applicable."""
    clauses = set(clause_catalogue())
    entries = [_mutation(raw, clauses) for raw in yaml.safe_load(path.read_text()) or []]
    seen: set[str] = set()
    for m in entries:
        if m.id in seen:
            raise CatalogueError(f"{m.id}: listed twice")
        seen.add(m.id)
        if m.kind == "template":
            m.template()
        elif m.kind == "onboarding":
            m.onboarding_class()
    return entries


def entry(ident: str) -> Mutation:
    """The catalogue entry ``ident``."""
    found = [m for m in load() if m.id == ident]
    if not found:
        raise CatalogueError(f"no mutation {ident!r} in {CATALOGUE}")
    return found[0]
