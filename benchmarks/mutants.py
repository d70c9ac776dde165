"""The kill matrix: every entry of the mutation catalogue against the clauses it must fail.

Run with ``bin/rayproof bench mutants [--clause ID ...] [--id ENTRY ...]
[--platform-profile FILE] [--out DIR]``. For each entry of
``clusters/embedded/mutations/catalogue.yaml`` (or those naming the given
clauses or ids) it puts the one change on a reference platform and runs each
clause the entry must fail, exactly as ``rayproof certify`` runs it (a
pytest subprocess). Each (entry, clause) ends as:

* ``killed``: the clause failed and its message names the entry's cause;
* ``other cause``: it failed, or errored, for something else;
* ``survived``: it passed (or was not applicable) on the broken platform,
  a suite bug unless the entry is shown not to break the clause's MUST.

Entries that change a golden template, an onboarding class or the
certification profile share one platform with the default settings
(``mutbase``); each entry that changes the platform's own settings gets a
platform of its own (``mutplat``), taken down before the next. Progress is
printed as each row ends, and each row is appended to ``DIR/rows.jsonl``
(default ``out/mutants-<UTC time>``) with the run's output beside it, so an
interrupted run (Ctrl-C) keeps its finished rows: the matrix printed then is
of those, and the platform is taken down. ``--resume DIR`` goes on with such
a run: it keeps the rows measured with this suite (every file a verdict
depends on, digested) and this version of their entry, and runs the rest,
so the whole catalogue (hours on two cores) can be measured in parts and
still be one matrix of one suite. It exits 0 when every row was
killed, 1 otherwise, 2 on bad input, 130 interrupted. It asserts nothing
about time; the time each row took is printed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from benchmarks import machine
from clusters.embedded import build
from clusters.embedded.mutations import CATALOGUE, TEMPLATE_FILES, CatalogueError, Mutation, load
from core import processes, timeouts
from core.catalogue import CLAUSES_AT_ONCE, UPGRADE_CLAUSE, clause_tests
from core.schema import merged
from core.timeouts import Tier

REPO = Path(__file__).resolve().parents[1]
INTERRUPTED_EXIT = 2  # pytest.ExitCode.INTERRUPTED: a Ctrl-C, not a verdict
BASE_PLATFORM, OWN_PLATFORM = "mutbase", "mutplat"  # neither name a prefix of the other's resources
KILLED, OTHER_CAUSE, SURVIVED = "killed", "other cause", "survived"
ROWS = "rows.jsonl"
# Everything a row's verdict depends on besides its entry: the clauses, the
# faults, the plugin, the workloads, the core, the reference platform (its
# golden templates and onboarding classes included) and this benchmark.
SUITE_PARTS = ("conformance", "chaos", "fixtures", "workloads", "core", "clusters", "benchmarks/mutants.py",
               "pyproject.toml")
SUITE_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".json", ".sh", ".go", ".mod", ".sum")

# How long a nested clause run may take to reach its fault. On two cores,
# beside the clauses on the session's platform and the runtime tier, the gang
# of a self-test's training was evicted twice by Kueue's 120 s
# waitForPodsReady before its first checkpoint (TRN-1's self-test, this
# machine, 2026-12-02: the process group formed 15 min after submission), so
# its wait for a checkpoint (training_run, 600 s) ran out before the fault.
# This sets only how long the run may take to get there, never what the
# clause judges.
NESTED_TRAINING_RUN_S = 2 * timeouts.TRAINING_RUN.seconds
# One clause run, platform start included, on two cores, after waiting for
# its clause's share of the platform and a host slot.
CLAUSE_RUN = Tier("selftest_clause_run", NESTED_TRAINING_RUN_S + 600 + timeouts.CLUSTER_SHARE.seconds,
                  "one clause run in a subprocess")


def suite_digest(repo: Path = REPO) -> str:
    """SHA-256 over the files of :data:`SUITE_PARTS` but the catalogue
    (whose entries are digested one by one, see ``Mutation.digest``)."""
    h = hashlib.sha256()
    for part in SUITE_PARTS:
        root = repo / part
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and p.suffix in SUITE_SUFFIXES and "__pycache__" not in p.parts)
        for path in files:
            if path.relative_to(repo) == CATALOGUE.relative_to(REPO):
                continue
            h.update(f"{path.relative_to(repo)}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def resumed_rows(out: Path, suite: str, entries: dict[str, Mutation],
                 chosen: set[tuple[str, str]]) -> tuple[list[dict[str, Any]], int]:
    """The rows of ``out/rows.jsonl`` that still count (this ``suite``, the
    entry's present version, a chosen row, not interrupted; the last of a
    row measured twice) and how many were dropped. The file is rewritten to
    those rows, the old one kept beside it as ``rows.superseded-*.jsonl``."""
    path = out / ROWS
    lines = path.read_text().splitlines() if path.exists() else []
    kept: dict[tuple[str, str], dict[str, Any]] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        key = (row.get("mutation"), row.get("clause"))
        m = entries.get(str(key[0]))
        if (key in chosen and m is not None and row.get("suite") == suite and row.get("entry") == m.digest()
                and not row.get("interrupted") and row.get("verdict") in (KILLED, OTHER_CAUSE, SURVIVED)):
            kept[key] = row  # type: ignore[index]
    dropped = len(lines) - len(kept)
    if dropped:
        path.rename(out / f"rows.superseded-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}.jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in kept.values()))
    return list(kept.values()), dropped


def run_clause(workdir: Path, test: str, *, profile: dict | None = None, platform: str | None = None,
               platform_profile: Path | str | None = None, bounds: dict[str, float] | None = None,
               options: Sequence[str] = ()) -> dict[str, Any]:
    """Run one clause (``path::test``) as certify does, with pytest
    ``options`` (certify's own, e.g. ``--upgrade-to``); return its result row
    with the run's output. ``bounds`` (timeout tier name: seconds) shortens
    waits the broken platform is known to wait out in full (a RayJob that
    never settles): how long the run looks, never what it judges."""
    workdir.mkdir(parents=True, exist_ok=True)
    results = workdir / "results.json"
    results.unlink(missing_ok=True)  # a row run again must not read its last attempt's results
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
            "--rootdir", str(REPO), str(REPO / test), "-q", f"--rayproof-results={results}"]
    if profile:
        path = workdir / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        argv += ["--profile", str(path)]
    if platform is not None:
        argv += ["--platform-name", platform]
    if platform_profile is not None:
        argv += ["--platform-profile", str(platform_profile)]
    argv += options
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=CLAUSE_RUN.seconds,
                          env={"RAYPROOF_TIMEOUT_TRAINING_RUN": str(NESTED_TRAINING_RUN_S), **os.environ,
                               **{f"{timeouts.OVERRIDE_PREFIX}{t.upper()}": f"{s:g}" for t, s in (bounds or {}).items()},
                               processes.DIE_WITH_PARENT_ENV: str(os.getpid())})
    (workdir / "run.log").write_text(proc.stdout + proc.stderr)
    assert results.exists(), (f"the clause run wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                              f"{proc.stderr[-2000:]}")
    written = json.loads(results.read_text())
    rows = [r for r in written["results"] if r["nodeid"].endswith(test.split("::")[-1])]
    # A Ctrl-C, or a clause that could not start while other work held the machine: no verdict either way.
    interrupted = written.get("exit_status") == INTERRUPTED_EXIT or bool(rows and rows[-1].get("not_run"))
    assert rows or interrupted, f"no result for {test}:\n{proc.stdout[-3000:]}"
    return {**(rows[-1] if rows else {"outcome": "error"}), "output": proc.stdout, "interrupted": interrupted}


def clause_options(clause: str) -> tuple[str, ...]:
    """certify's own options a clause needs to be judged at all: UPG-1
    upgrades the operator to the version the platform runs (its procedure,
    not a new version, is what the entries change)."""
    if clause == UPGRADE_CLAUSE:
        return ("--upgrade-to", build.load_versions()["kuberay"]["version"])
    return ()


def verdict(row: dict[str, Any], causes: Sequence[str]) -> str:
    """``killed`` where the clause failed naming one of ``causes``; else ``other cause`` or ``survived``."""
    if row["outcome"] in ("passed", "not_applicable"):
        return SURVIVED
    named = any(c.lower() in (row.get("message") or "").lower() for c in causes)
    return KILLED if row["outcome"] == "failed" and named else OTHER_CAUSE


def template_profile(mutation: Mutation, directory: Path) -> dict[str, Any]:
    """The certification profile pointing the entry's golden template at a changed copy in ``directory``."""
    name, obj = mutation.template()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"mutated-{TEMPLATE_FILES[name]}"
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return {"templates": {name: str(path)}}


def installed_onboarding_class(api: Any, mutation: Mutation) -> tuple[dict[str, Any], Callable[[], None]]:
    """Install, as the platform's operators would, the reference onboarding
    class with the entry's change; returns the profile pointing teams at it
    and what removes it."""
    from kubernetes import client

    from clusters.embedded.onboarding.controller import CLASS_LABEL, CLASSES_NAMESPACE, Onboarding, class_configmap_name

    cls = f"mut-{mutation.id}"[:50].rstrip("-")
    Onboarding(api).install_classes({cls: yaml.safe_dump_all(mutation.onboarding_class(), sort_keys=False)})

    def remove() -> None:
        try:
            client.CoreV1Api(api).delete_namespaced_config_map(class_configmap_name(cls), CLASSES_NAMESPACE)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
    return {"teams": {"namespaceLabels": {CLASS_LABEL: cls}}}, remove


def profile_on(api: Any, mutation: Mutation, directory: Path) -> tuple[dict[str, Any], Callable[[], None]]:
    """The certification profile that puts ``mutation`` in force on the
    platform of ``api`` (a changed template, an installed class, or the
    entry's own profile), and what undoes what it installed."""
    if mutation.kind == "template":
        return merged(mutation.profile(), template_profile(mutation, directory)), lambda: None
    if mutation.kind == "onboarding":
        return installed_onboarding_class(api, mutation)
    return mutation.profile(), lambda: None


class InForce:
    """Each entry's change put on once for all of its rows that run at once,
    undone when the last of them ends. Undone per row, an onboarding class
    removed as one clause ended left the next namespace of another clause of
    the same entry without it (measured: SEC-2 failing "no onboarding class"
    beside the entry's GCS-2, three rows at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, dict[str, Any], Callable[[], None]]] = {}

    @contextlib.contextmanager
    def change(self, m: Mutation, put_on: Callable[[], tuple[dict[str, Any], Callable[[], None]]]
               ) -> Iterator[dict[str, Any]]:
        """The certification profile that puts ``m`` in force (``put_on`` makes it, the first time)."""
        with self._lock:
            count, profile, undo = self._held.get(m.id) or (0, *put_on())
            self._held[m.id] = (count + 1, profile, undo)
        try:
            yield profile
        finally:
            with self._lock:
                count, profile, undo = self._held[m.id]
                if count == 1:
                    del self._held[m.id]
                    undo()
                else:
                    self._held[m.id] = (count - 1, profile, undo)


@contextlib.contextmanager
def _platform(name: str, overlay: dict[str, Any], base: dict[str, Any], directory: Path,
              say: Callable[[str], None]) -> Iterator[tuple[Any, Path]]:
    from clusters.embedded.target import EmbeddedTarget
    from fixtures.sharing import host_slot

    path = directory / f"{name}-platform-profile.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(merged(base, overlay)))
    with host_slot():
        target = EmbeddedTarget.start(name=name, profile=path, progress=say)
        try:
            yield target, path
        finally:
            target.close()


def plan(chosen: list[tuple[Mutation, str]]) -> tuple[list[tuple[Mutation, str]],
                                                      list[tuple[Mutation, list[tuple[Mutation, str]]]]]:
    """The (entry, clause) rows that share the reference platform, and per
    entry that needs a platform of its own, its rows."""
    shared = [(m, c) for m, c in chosen if not m.needs_own_platform()]
    own: dict[str, tuple[Mutation, list[tuple[Mutation, str]]]] = {}
    for m, c in chosen:
        if m.needs_own_platform():
            own.setdefault(m.id, (m, []))[1].append((m, c))
    return shared, list(own.values())


def matrix(rows: list[dict[str, Any]]) -> str:
    """The kill matrix, entry by clause, with the kill rate and the time taken."""
    clauses = sorted({r["clause"] for r in rows})
    entries = list(dict.fromkeys(r["mutation"] for r in rows))
    cell = {(r["mutation"], r["clause"]): r for r in rows}
    mark = {KILLED: "killed", OTHER_CAUSE: "OTHER", SURVIVED: "SURVIVED"}
    width = max([len(e) for e in entries] + [8])
    lines = [f"{'mutation':{width}s}  " + "  ".join(f"{c:8s}" for c in clauses)]
    for e in entries:
        lines.append(f"{e:{width}s}  " + "  ".join(
            f"{mark[cell[(e, c)]['verdict']] if (e, c) in cell else '':8s}" for c in clauses))
    killed = sum(r["verdict"] == KILLED for r in rows)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in (KILLED, OTHER_CAUSE, SURVIVED)}
    took = sum(r["seconds"] for r in rows)
    lines.append(f"kill rate {killed}/{len(rows)} ({killed / len(rows):.0%}); " if rows else "no rows; ")
    lines[-1] += (f"{counts[OTHER_CAUSE]} failed for another cause, {counts[SURVIVED]} survived; "
                  f"clause runs {took:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayproof bench mutants", description=__doc__.split("\n")[0])
    parser.add_argument("--clause", action="append", default=[], help="only entries that must fail this clause "
                                                                      "(repeatable), and only that clause of them")
    parser.add_argument("--id", action="append", default=[], help="only this catalogue entry (repeatable)")
    parser.add_argument("--platform-profile", help="the platforms' profile under each change (default: the "
                                                   "reference platform's)")
    parser.add_argument("--jobs", type=int, default=CLAUSES_AT_ONCE,
                        help=f"rows run at once on one platform (default {CLAUSES_AT_ONCE}, as certify runs clauses; "
                             "each still waits for its share of the cluster and a host slot)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="where rows.jsonl, matrix.txt and each run's output go "
                                     "(default: out/mutants-<UTC time>)")
    where.add_argument("--resume", metavar="DIR", help="go on with the run in DIR: keep its rows of this suite and "
                                                       "entry version, run the rest of the chosen rows")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1; got {args.jobs}")
    try:
        entries = load()
    except CatalogueError as exc:
        print(f"rayproof bench mutants: the catalogue does not fit the reference platform: {exc}", file=sys.stderr)
        return 2
    tests = clause_tests()
    unknown = sorted(set(args.clause) - set(tests)) + sorted(set(args.id) - {m.id for m in entries})
    if unknown:
        parser.error(f"unknown clause or entry: {', '.join(unknown)}")
    chosen = [(m, c) for m in entries if not args.id or m.id in args.id
              for c in m.clauses if not args.clause or c in args.clause]
    if not chosen:
        parser.error("no catalogue entry matches")
    try:
        base = (yaml.safe_load(Path(args.platform_profile).read_text()) or {}) if args.platform_profile else {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--platform-profile {args.platform_profile}: {exc}")
    suite = suite_digest()
    if args.resume:
        out = Path(args.resume)
        if not (out / ROWS).is_file():
            parser.error(f"--resume {out}: no {ROWS} there; start a run with --out")
        rows, dropped = resumed_rows(out, suite, {m.id: m for m in entries}, {(m.id, c) for m, c in chosen})
    else:
        out = Path(args.out or REPO / "out" / f"mutants-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}")
        if out.exists() and any(out.iterdir()):
            parser.error(f"--out {out} is not empty")
        out.mkdir(parents=True, exist_ok=True)
        rows, dropped = [], 0
    done = {(r["mutation"], r["clause"]) for r in rows}
    total = len(chosen)
    chosen = [(m, c) for m, c in chosen if (m.id, c) not in done]

    def say(message: str) -> None:
        print(f"rayproof bench: {message}", file=sys.stderr, flush=True)

    lock = threading.Lock()
    began = time.monotonic()

    in_force = InForce()

    def run_row(m: Mutation, clause: str, platform: Any, platform_profile: Path) -> None:
        workdir = out / m.id / clause
        t0 = time.monotonic()
        with in_force.change(m, lambda: profile_on(platform.api_client(), m, workdir / "golden")) as profile:
            try:
                row = run_clause(workdir, tests[clause], profile=profile, platform=platform.name,
                                 platform_profile=platform_profile, bounds=m.bounds, options=clause_options(clause))
            except (AssertionError, subprocess.TimeoutExpired) as exc:
                row = {"outcome": "error", "message": f"the clause run did not report: {str(exc)[:800]}"}
        result = {"mutation": m.id, "clause": clause, "verdict": verdict(row, m.expect[clause]),
                  "outcome": row["outcome"], "seconds": round(time.monotonic() - t0, 1),
                  "message": (row.get("message") or "")[:1500], "causes": list(m.expect[clause]),
                  "suite": suite, "entry": m.digest()}
        with lock:
            with (out / ROWS).open("a") as f:
                f.write(json.dumps({**result, "interrupted": bool(row.get("interrupted"))}) + "\n")
            if row.get("interrupted"):
                say(f"{m.id} x {clause}: interrupted or could not start, not counted ({result['seconds']:.0f} s)")
                return
            rows.append(result)
            say(f"[{len(rows)}/{total}] {m.id} x {clause}: {result['verdict']} ({result['outcome']}, "
                f"{result['seconds']:.0f} s)")

    def run_rows(pairs: list[tuple[Mutation, str]], platform: Any, platform_profile: Path) -> None:
        """``pairs`` on ``platform``, ``--jobs`` at a time; a Ctrl-C reaches
        the clause runs too (one process group), so they end and report."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_row, m, clause, platform, platform_profile) for m, clause in pairs]
            try:
                for future in concurrent.futures.as_completed(futures):
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    shared, own = plan(chosen)
    if args.resume:
        say(f"resuming {out}: {len(rows)} rows of this suite kept, {dropped} dropped (another suite or entry "
            f"version, or interrupted), {len(chosen)} to run")
    say(f"{len(chosen)} rows: {len(shared)} on one reference platform, {len(chosen) - len(shared)} on "
        f"{len(own)} platforms of their own; results in {out}")
    interrupted = False
    try:
        if shared:
            with _platform(BASE_PLATFORM, {}, base, out, say) as (target, path):
                run_rows(shared, target.platform, path)
        for m, pairs in own:
            say(f"platform with {m.id}: {json.dumps(m.platform_profile())}")
            with _platform(OWN_PLATFORM, m.platform_profile(), base, out, say) as (target, path):
                run_rows(pairs, target.platform, path)
    except KeyboardInterrupt:
        interrupted = True
        say(f"interrupted; the matrix below is of the {len(rows)} rows that finished")
    table = matrix(rows)
    (out / "matrix.txt").write_text(table + "\n")
    print(json.dumps({"benchmark": "mutants", "machine": machine(), "rows": rows,
                      "wall_s": round(time.monotonic() - began, 1), "interrupted": interrupted}, indent=1))
    print(table)
    if interrupted:
        return 130
    return 0 if rows and all(r["verdict"] == KILLED for r in rows) else 1
