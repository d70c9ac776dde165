"""The ``rayproof`` command: certify a platform, run the project's tests, report, clean up."""
from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from core import timeouts
from core.catalogue import CLAUSES_AT_ONCE, UPGRADE_CLAUSE

REPO = Path(__file__).resolve().parents[1]
# pytest-xdist workers, for `test` and `certify` alike (why three: the
# catalogue's CLAUSES_AT_ONCE). Self-tests that start platforms of their own
# share one group.
WORKERS = ["-n", str(CLAUSES_AT_ONCE), "--dist", "loadgroup"]
# `bin/rayproof test`'s JUnit XML report, in the checkout (ignored by git).
JUNIT_XML = "junit.xml"
# certify's exit statuses (documented in `certify --help` and the README).
CERTIFIED_EXIT = 0  # every clause ran to completion and passed, default bounds
NOT_CERTIFIED_EXIT = 1  # a clause failed or could not be judged
BAD_INPUT_EXIT = 2  # bad options, profile or kubeconfig; nothing was created
NO_VERDICT_EXIT = 3  # PARTIAL, INCOMPLETE or NON-DEFAULT: the run speaks for less than the whole platform
# The cluster cannot be certified as it is (preflight); nothing was created.
# The same status as fixtures.kube.PREFLIGHT_EXIT, for a plain pytest run.
PREFLIGHT_EXIT = 4
INTERNAL_ERROR_EXIT = 5  # the run ended without results (a crash of the suite itself)
CLEAN_REFUSED_EXIT = 1  # `clean --run ID` of a run whose lease is still renewed
REGRESSION_EXIT = 1  # `compare OLD NEW`: a clause's outcome got worse or a figure left its range
VERIFY_FAILED_EXIT = 1  # `verify BUNDLE`: a file or the certificate differs from what the bundle says
CERTIFY_EXITS = f"""exit status:
  {CERTIFIED_EXIT}  CERTIFIED: every clause ran to completion and passed, with default bounds
  {NOT_CERTIFIED_EXIT}  NOT CERTIFIED: a clause failed or could not be judged
  {BAD_INPUT_EXIT}  bad input (options, profile, kubeconfig or context); nothing was created
  {NO_VERDICT_EXIT}  PARTIAL (a subset of the clauses, -k), INCOMPLETE (interrupted) or NON-DEFAULT
     (RAYPROOF_TIMEOUT_* set): no verdict on the whole platform
  {PREFLIGHT_EXIT}  preflight refused the cluster (unreachable, CRDs, RBAC, profile objects), or the embedded
     platform could not be had as asked (in use, started by `up` with another profile, machine short);
     nothing was created
  {INTERNAL_ERROR_EXIT}  internal error: the run ended without results"""


def _pytest(args: list[str]) -> int:
    import pytest

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return int(pytest.main(["--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), *args]))


def cmd_test(args: argparse.Namespace) -> int:
    """The project's own tests: unit tests, the clauses, and the clauses' self-tests (one tier of the clause
    passes and self-tests, by the commit count; --all: every one)."""
    extra = list(args.pytest_args)
    everything = "--all" in extra
    if everything:
        extra.remove("--all")
    parallel = [] if any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in extra) else WORKERS
    # The slowest items, so a run that grows longer says where its time went.
    durations = [] if any(a.startswith("--durations") for a in extra) else ["--durations=40"]
    tier = [] if everything or any(a.startswith("--tier") for a in extra) else ["--tier", test_tier()]
    # CI keeps the JUnit report; its properties name the tier that ran.
    junit = [] if any(a.startswith("--junit") for a in extra) else [f"--junitxml={REPO / JUNIT_XML}"]
    return _pytest([*parallel, *durations, *tier, *junit, str(REPO / "tests"), str(REPO / "conformance"), *extra])


def test_tier() -> str:
    """This commit's tier of the clause passes and self-tests (fixtures/plugin.py's TIERS): the commit count
    mod TIERS, so consecutive commits' CI runs cover every one; said on standard output."""
    import subprocess

    from fixtures.plugin import TIERS

    try:
        count = int(subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                   timeout=30, check=True).stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        count = 0  # not a git checkout: tier 0
    tier = f"{count % TIERS}/{TIERS}"
    print(f"rayproof: test tier {tier} (commit count {count}): one of {TIERS} shares of the clause passes and "
          f"self-tests runs now, the others in the next commits' runs (pytest lists the rest as deselected); "
          "`bin/rayproof test --all` runs every one", flush=True)
    return tier


def runner_rows() -> dict[str, str]:
    """The host that ran the suite, with the Ray and torch its clauses drive
    (the platform's own components are in the rows of the target)."""
    import ray
    import torch

    return {
        "runner": "the host that ran the suite",
        "ray": ray.__version__,
        "torch": torch.__version__,
        "python": pyplatform.python_version(),
        "kernel": pyplatform.release(),
        "machine": f"{os.cpu_count()} CPUs, {_memory_gib()} GiB",
    }


def _memory_gib() -> str:
    try:
        import psutil

        return f"{psutil.virtual_memory().total / 2**30:.0f}"
    except ImportError:
        return "?"


def target_rows(target: dict | None) -> dict[str, str]:
    """The certified cluster's description as report rows."""
    if not target:
        return {}
    rows = {"cluster": str(target.get("kind")), "API server": str(target.get("server")),
            "versions": ", ".join(f"{k} {v}" for k, v in (target.get("versions") or {}).items()),
            "nodes": f"{target.get('nodes')} ({'; '.join(f'{n} x {k}' for k, n in (target.get('node_shapes') or {}).items())})",
            "certification profile": str(target.get("certification_profile"))}
    for key, template in (target.get("golden_templates") or {}).items():
        rows[f"golden {key} template"] = f"{template['file']} (sha256 {template['sha256']})"
    return rows


# Linux's limits on a path and on one of its names (PATH_MAX, NAME_MAX).
PATH_MAX, NAME_MAX = 4095, 255


def bad_out_dir(out: Path) -> str | None:
    """Why ``out`` cannot take a certification's reports (None: it can):
    it must be a new or empty directory this user may write, its path within
    the kernel's limits. An existing file in it would be packed into the
    evidence bundle as if the run had written it."""
    if len(str(out)) > PATH_MAX or any(len(part) > NAME_MAX for part in out.parts):
        return f"its path is longer than this system allows ({NAME_MAX} characters a name, {PATH_MAX} in all)"
    if out.exists() and not out.is_dir():
        return "is a file, not a directory"
    if out.is_dir() and any(out.iterdir()):
        return "is not empty (a certification writes its reports and evidence bundle into a new or empty directory)"
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be written by this user ({ancestor} is not a writable directory)"
    return None


def clauses_selected(k: str) -> list[str]:
    """The clause tests ``-k k`` selects, collected (nothing run, no cluster touched)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), "-k", k,
                           str(REPO / "conformance")], capture_output=True, text=True, cwd=REPO,
                          timeout=timeouts.PYTEST_SESSION.seconds)
    return [line for line in proc.stdout.splitlines() if "::" in line]


def cmd_certify(args: argparse.Namespace) -> int:
    """Run every clause against the platform and write JUnit, Allure and the certification summary
    (with --upgrade-to: certify, upgrade the KubeRay operator under load, certify again, compare)."""
    from core import processes
    from core import profile as profile_mod

    out = Path(args.out or REPO / "out" / time.strftime("certification-%Y%m%dT%H%M%SZ", time.gmtime())).resolve()
    if why := bad_out_dir(out):
        print(f"rayproof: --out {out} {why}; pass a new or empty directory", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.kubeconfig and not Path(args.kubeconfig).expanduser().is_file():
        print(f"rayproof: kubeconfig {args.kubeconfig} does not exist; pass the path of a kubeconfig file "
              "(or omit --kubeconfig to certify the embedded platform)", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.kubeconfig and (args.platform_name or args.platform_profile):
        print("rayproof: --platform-name and --platform-profile apply to the embedded platform, not to --kubeconfig",
              file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.upgrade_to and (why := _bad_upgrade_target(args)):
        print(f"rayproof: --upgrade-to {args.upgrade_to}: {why}", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.sign_key:
        from reports import attestation

        try:
            attestation.load_private_key(Path(args.sign_key).expanduser())
        except attestation.BadKey as exc:
            print(f"rayproof: {exc}", file=sys.stderr)
            return BAD_INPUT_EXIT
    try:
        profile = profile_mod.load(args.profile)
    except profile_mod.ProfileError as exc:
        print(f"rayproof: bad profile: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    if args.k and not clauses_selected(args.k):
        print(f"rayproof: -k {args.k!r} selects no clause (clause ids such as NET-2, or test names; "
              "`pytest --collect-only conformance` lists them); nothing was run", file=sys.stderr)
        return BAD_INPUT_EXIT
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so a platform this
    # run brought up comes down again.
    previous = signal.signal(signal.SIGTERM, processes.unwind_on_sigterm)
    try:
        target = _open_certified_cluster(args, profile)
        if isinstance(target, int):
            return target
        try:
            if not args.upgrade_to:
                return _certification(args, profile, target, out)
            return _upgrade_certification(args, profile, target, out)
        finally:
            target.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bad_upgrade_target(args: argparse.Namespace) -> str | None:
    """Why ``--upgrade-to`` cannot be done (None: it can)."""
    import re

    if not re.fullmatch(r"v\d+\.\d+\.\d+", args.upgrade_to):
        return "a KubeRay version looks like v1.6.0"
    if not args.kubeconfig:
        from clusters.embedded import build

        known = build.kuberay_upgrade_versions()
        if args.upgrade_to not in known:
            return (f"the embedded platform can be upgraded to {', '.join(known) or 'no version'} (locked in "
                    "clusters/embedded/upgrades/; `python -m clusters.embedded.build --relock-kuberay VERSION` "
                    "locks another)")
    return None


def _certification(args: argparse.Namespace, profile: Any, target: Any, out: Path,
                   extra: tuple[str, ...] = ()) -> int:
    """One certification run of ``target`` into ``out``: pytest over the
    clauses, then the certificate, Allure timelines and the evidence bundle;
    returns certify's exit status."""
    import yaml

    from reports import bundle, timeline
    from reports import summary as summary_mod

    results = out / "results.json"
    began = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    print(f"rayproof: certifying; reports go to {out}", flush=True)
    described = {**target.describe(), "certification_profile": profile.source,
                 "golden_templates": profile.template_digests()}
    opened = out / "opened-cluster.json"  # preflight passed (_open_certified_cluster): the workers only connect
    opened.write_text(json.dumps({"target": described, "preflight": "passed"}, indent=2, default=str))
    rc = _pytest([*WORKERS, f"--rayproof-opened={opened}", *_certify_pytest_args(args, out, results), *extra])
    if not results.exists():
        if rc == 2:
            print("rayproof: INCOMPLETE — the run was interrupted before any result was written", file=sys.stderr)
            return NO_VERDICT_EXIT
        print(f"rayproof: the run wrote no results (pytest exit {rc}); nothing to certify", file=sys.stderr)
        return PREFLIGHT_EXIT if rc == PREFLIGHT_EXIT else INTERNAL_ERROR_EXIT
    runner = runner_rows()
    platform = {**runner, **target_rows(described)}
    platform["certification wall time"] = f"{time.monotonic() - began:.0f} s"
    summary = summary_mod.write(results, platform, out)
    timeline.attach_to_allure(out / "allure-results", summary["clauses"])
    archive = bundle.write(out, profile_yaml=yaml.safe_dump(profile.data, sort_keys=False),
                           templates=described.get("golden_templates") or {},
                           versions=bundle.versions(described, runner, REPO))
    print(f"rayproof: {summary['verdict']} — {summary['verdict_reason']} — {out / 'certification.md'}")
    print(f"rayproof: evidence bundle {archive} (check it offline: bin/rayproof verify {archive})")
    if args.sign_key:
        from reports import attestation

        signed = attestation.sign(archive, Path(args.sign_key).expanduser(), summary)
        print(f"rayproof: signed statement {signed} (check it: bin/rayproof verify {archive} --key <public key>)")
    return {summary_mod.CERTIFIED: CERTIFIED_EXIT, summary_mod.NOT_CERTIFIED: NOT_CERTIFIED_EXIT}.get(
        summary["verdict"], NO_VERDICT_EXIT)




def _upgrade_certification(args: argparse.Namespace, profile: Any, target: Any, out: Path) -> int:
    """Certify (``out/before``), upgrade the KubeRay operator while a
    RayService serves load and a RayJob trains (UPG-1, ``out/upgrade``),
    certify again (``out/after``) and compare the two (``out/comparison.txt``);
    ``out/upgrade.md`` says it all in one page. CERTIFIED only when both
    certifications are and UPG-1 passed. With ``-k`` the certifications before
    and after are of those clauses (PARTIAL, so never CERTIFIED) and UPG-1
    runs as always: a quick look at what an upgrade does to a few clauses."""
    from reports import compare

    began_with = target.describe()["versions"].get("kuberay")
    if began_with == args.upgrade_to:
        print(f"rayproof: --upgrade-to {args.upgrade_to}: the KubeRay operator already runs it; nothing to upgrade",
              file=sys.stderr)
        return BAD_INPUT_EXIT
    print(f"rayproof: upgrade certification: KubeRay {began_with} -> {args.upgrade_to}; reports go to {out}",
          flush=True)
    target.prepare_kuberay_upgrade(args.upgrade_to, progress=lambda m: print(f"rayproof: {m}", flush=True))
    statuses = {"before": _certification(args, profile, target, out / "before")}
    if statuses["before"] in (PREFLIGHT_EXIT, INTERNAL_ERROR_EXIT) or not (out / "before" / "results.json").exists():
        return statuses["before"]
    # One clause in one worker (never in this process, which holds the
    # platform open), its output not captured: on an existing cluster it
    # tells the person, on standard error, when to upgrade.
    statuses["upgrade"] = _certification(args, profile, target, out / "upgrade",
                                         extra=("-n", "1", "-s", "-k", UPGRADE_CLAUSE, "--upgrade-to", args.upgrade_to))
    upgraded = _clause_row(out / "upgrade", UPGRADE_CLAUSE)
    if not upgraded or upgraded["outcome"] != "passed":
        print(f"rayproof: {UPGRADE_CLAUSE} did not pass; the platform is not certified again after a failed "
              f"upgrade ({out / 'upgrade' / 'certification.md'})", file=sys.stderr)
        _write_upgrade_page(out, began_with, args.upgrade_to, upgraded, None)
        return NOT_CERTIFIED_EXIT if upgraded else statuses["upgrade"]
    statuses["after"] = _certification(args, profile, target, out / "after")
    if not (out / "after" / "results.json").exists():
        return statuses["after"]
    comparison = compare.compare(compare.load(out / "before"), compare.load(out / "after"))
    (out / "comparison.txt").write_text(compare.to_text(comparison) + "\n")
    _write_upgrade_page(out, began_with, args.upgrade_to, upgraded, comparison)
    print(f"rayproof: upgrade certification written to {out / 'upgrade.md'}")
    if statuses["before"] == statuses["after"] == CERTIFIED_EXIT and not comparison.regressions:
        return CERTIFIED_EXIT
    return NOT_CERTIFIED_EXIT if NOT_CERTIFIED_EXIT in statuses.values() or comparison.regressions \
        else NO_VERDICT_EXIT


def _clause_row(directory: Path, clause: str) -> dict[str, Any] | None:
    try:
        rows = json.loads((directory / "results.json").read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None
    return next((r for r in rows if r.get("clause") == clause), None)


def _write_upgrade_page(out: Path, before: str | None, after: str, upgraded: dict[str, Any] | None,
                        comparison: Any) -> None:
    """``out/upgrade.md``: the two verdicts, UPG-1's outcome and its figures, the comparison."""
    from reports import compare

    def verdict(name: str) -> str:
        try:
            data = json.loads((out / name / "certification.json").read_text())
            return f"{data['verdict']} — {data['verdict_reason']}"
        except (OSError, ValueError, KeyError):
            return "not run"

    evidence = (upgraded or {}).get("evidence") or {}
    lines = [f"# rayproof upgrade certification: KubeRay {before} -> {after}", "",
             f"- before the upgrade: {verdict('before')} ([certificate](before/certification.md))",
             f"- {UPGRADE_CLAUSE}, the upgrade under load: {(upgraded or {}).get('outcome', 'not run')}"
             f" ([report](upgrade/certification.md))" + (f": {upgraded['message']}" if upgraded and upgraded.get("message")
                                                         else ""),
             f"- after the upgrade: {verdict('after')} ([certificate](after/certification.md))", "",
             "## Across the upgrade", ""]
    figures = evidence.get("figures") or {}
    lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in figures.items()] or ["(no figures)"]
    if evidence.get("availability_during_upgrade"):
        lines.append(f"- availability during the upgrade: {evidence['availability_during_upgrade']}")
    lines += ["", "## Before and after", "", "```", compare.to_text(comparison) if comparison else "not compared", "```", ""]
    (out / "upgrade.md").write_text("\n".join(lines))


def _open_certified_cluster(args: argparse.Namespace, profile: Any) -> Any:
    """The cluster to certify (the embedded platform brought up when it is not
    running), checked by preflight; an exit status, with the reason printed,
    when it cannot be certified. The workers connect to it; this process owns it."""
    from clusters import open_target
    from clusters.embedded.machine import UpRefused
    from clusters.preflight import PreflightError, preflight

    try:
        target = open_target(args.kubeconfig, context=args.context, platform_name=args.platform_name,
                             platform_profile=args.platform_profile,
                             progress=lambda m: print(f"rayproof: {m}", flush=True))
    except (FileNotFoundError, ValueError) as exc:  # a bad --kubeconfig, context, platform name or platform profile
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    except UpRefused as exc:  # the platform in use by other sessions, or a machine short of what it needs
        print(f"rayproof: {exc}; nothing was created", file=sys.stderr)
        return PREFLIGHT_EXIT
    try:
        preflight(target.api_client(), profile)
    except PreflightError as exc:
        target.close()
        print(f"rayproof preflight: {exc}", file=sys.stderr)
        print("rayproof: the cluster cannot be certified as it is; nothing was created", file=sys.stderr)
        return PREFLIGHT_EXIT
    sweep_ended_runs(target.api_client())
    return target


def _certify_pytest_args(args: argparse.Namespace, out: Path, results: Path) -> list[str]:
    pytest_args = [str(REPO / "conformance"), "-v", f"--junitxml={out / 'junit.xml'}",
                   f"--alluredir={out / 'allure-results'}", f"--rayproof-results={results}", "-o", "junit_family=xunit2"]
    if args.k:
        pytest_args += ["-k", args.k]
    for option in ("kubeconfig", "context", "profile", "platform_name", "platform_profile"):
        if getattr(args, option):
            pytest_args += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    if args.reveal_tenant_names:
        pytest_args.append("--reveal-tenant-names")
    return pytest_args


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild the certification summary from a results.json, without a cluster."""
    from reports import summary as summary_mod

    results = Path(args.results)
    if not results.is_file():
        print(f"rayproof: {results} does not exist (pass the results.json of a certification run)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else results.parent
    try:
        recorded = json.loads(results.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"rayproof: {results} is not the results.json of a certification run ({type(exc).__name__}: "
              f"{str(exc)[:120]})", file=sys.stderr)
        return BAD_INPUT_EXIT
    if not isinstance(recorded, dict) or not isinstance(recorded.get("results"), list):
        print(f"rayproof: {results} is not the results.json of a certification run (JSON without a list of results)",
              file=sys.stderr)
        return BAD_INPUT_EXIT
    if out.exists() and not out.is_dir():
        print(f"rayproof: --out {out} is a file, not a directory", file=sys.stderr)
        return BAD_INPUT_EXIT
    platform = json.loads((results.parent / "certification.json").read_text())["platform"] \
        if (results.parent / "certification.json").exists() else {"platform": "unknown (regenerated)"}
    summary = summary_mod.write(results, platform, out)
    print(f"rayproof: {summary['verdict']} — {out / 'certification.md'}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check an evidence bundle offline: every file against its manifest, and its certificate against the one its
    results make."""
    from reports import attestation, bundle

    path = Path(args.bundle)
    if not path.is_file():
        print(f"rayproof: {path} does not exist (pass the certification-<time>.tar.gz a certify wrote)",
              file=sys.stderr)
        return BAD_INPUT_EXIT
    try:
        problems, summary = bundle.verify(path)
    except bundle.DamagedBundle as exc:
        print(f"rayproof verify: {exc}", file=sys.stderr)
        print(f"rayproof: {path} does NOT verify (its archive is damaged)")
        return VERIFY_FAILED_EXIT
    except bundle.BundleError as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    if _refused(problems, f"{path} does NOT verify ({len(problems)} problem{'s' if len(problems) > 1 else ''})"):
        return VERIFY_FAILED_EXIT
    print(f"rayproof: {path} verified: every file matches its manifest, and its certificate "
          f"({summary['verdict']}) is the one its results.json makes")
    signed = attestation.envelope_path(path)
    if args.key:
        try:
            problems = attestation.verify(path, signed, Path(args.key).expanduser(), summary)
        except attestation.BadKey as exc:
            print(f"rayproof: {exc}", file=sys.stderr)
            return BAD_INPUT_EXIT
        if _refused(problems, f"{path} does NOT verify: its signed statement {signed} does not vouch for it"):
            return VERIFY_FAILED_EXIT
        print(f"rayproof: signed by the holder of {args.key}: {signed} names this bundle and its certificate")
    elif signed.exists():
        print(f"rayproof: {signed} signs it; pass --key <public key> to check who did")
    written_by = bundle.suite_commit(path)
    if written_by != bundle.commit_of(REPO):
        print(f"rayproof: its Markdown and HTML were rendered by suite commit {written_by}, not this checkout's: "
              "compared its data (certification.json) only; check that commit out to compare them too")
    return 0


def _refused(problems: list[str], verdict: str) -> bool:
    """Print each of ``problems`` and then ``verdict``; True when there were any."""
    for problem in problems:
        print(f"rayproof verify: {problem}", file=sys.stderr)
    if problems:
        print(f"rayproof: {verdict}")
    return bool(problems)


def cmd_export(args: argparse.Namespace) -> int:
    """Export a verified evidence bundle to a certification program: cncf-ai writes the Kubernetes AI Conformance
    PRODUCT.yaml entries the bundle evidences (gang_scheduling, robust_controller), each pointing at its JUnit cases,
    with results/junit.xml and a version-stamped results/e2e.log; the checklist's other requirements listed as not
    covered."""
    from reports import bundle, cncf_ai

    path = Path(args.bundle)
    if not path.is_file():
        print(f"rayproof: {path} does not exist (pass the certification-<time>.tar.gz a certify wrote)",
              file=sys.stderr)
        return BAD_INPUT_EXIT
    out = Path(args.out or f"cncf-ai-{path.name.removesuffix('.tar.gz')}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"rayproof: {out} exists and is not an empty directory; pass --out with a new one", file=sys.stderr)
        return BAD_INPUT_EXIT
    try:
        export = cncf_ai.build(path, args.checklist)
    except (bundle.BundleError, cncf_ai.ExportError) as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    written = cncf_ai.write(export, out)
    for rid, status in export.covered.items():
        print(f"rayproof: {rid}: {status or 'no claim (see its notes)'}")
    print(f"rayproof: wrote {', '.join(str(p) for p in written)}; merge PRODUCT.yaml's entries into the program's "
          "template for your Kubernetes version and fill in its metadata")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare two certifications: per clause the outcome change and the change of every measured figure,
    regressions flagged (outcomes that got worse; figures outside --ranges)."""
    from reports import compare

    try:
        old, new = compare.load(Path(args.old)), compare.load(Path(args.new))
        ranges = compare.load_ranges(Path(args.ranges)) if args.ranges else None
    except compare.CertificateError as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    result = compare.compare(old, new, ranges)
    print(compare.to_text(result))
    return REGRESSION_EXIT if result.regressions else 0


def cmd_ranges(args: argparse.Namespace) -> int:
    """Build a ranges file for `compare --ranges` from repeated certifications of one platform."""
    import yaml

    from reports import compare

    try:
        certificates = [compare.load(Path(path)) for path in args.certifications]
        onto = compare.load_ranges(Path(args.add_to)) if args.add_to else None
    except compare.CertificateError as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    if len(certificates) + len((onto or {}).get("sources") or []) < 2:
        print("rayproof: a range needs at least two runs of the same platform", file=sys.stderr)
        return BAD_INPUT_EXIT
    slack = args.slack if args.slack is not None else float((onto or {}).get("slack", compare.DEFAULT_SLACK))
    try:
        ranges = compare.ranges_from(certificates, slack=slack, onto=onto)
    except compare.CertificateError as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    Path(args.out).write_text(yaml.safe_dump(ranges, sort_keys=True))
    figures = sum(len(f) for f in ranges["clauses"].values())
    print(f"rayproof: {args.out}: {figures} figures of {len(ranges['clauses'])} clauses from {ranges['runs']} runs")
    return 0


class BadInput(ValueError):
    pass


def cmd_clean(args: argparse.Namespace) -> int:
    """Remove what ended runs left behind (never a run whose owner lives or whose lease is renewed)."""
    from fixtures import janitor, leases

    try:
        older_than_s = _duration_s(args.older_than) if args.older_than else None
        run_id = leases.check_run_id(args.run) if args.run else None
    except ValueError as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT

    def cluster() -> Any:  # asked after the local sweep has taken down platforms left by dead sessions
        try:
            return janitor.cluster_to_clean(args.kubeconfig, args.context, args.platform_name)
        except Exception as exc:  # noqa: BLE001 - said in one line, as bad input
            raise BadInput(f"cannot use kubeconfig {args.kubeconfig} (context {args.context or 'current'}): {exc}")
    try:
        if run_id:  # nothing local is swept for one run: ask the cluster first
            api = cluster()
            if api is None:
                raise BadInput("--run needs a cluster: pass --kubeconfig (or bring the embedded platform up)")
            state = leases.run_states(api).get(run_id)
            if state and state.live:
                print(f"rayproof: {state.describe()}; not touching it", file=sys.stderr)
                return CLEAN_REFUSED_EXIT
            swept = janitor.sweep(cluster=lambda: api, run_id=run_id)
        elif args.kubeconfig or args.platform_name:
            swept = janitor.sweep(cluster=cluster, older_than_s=older_than_s)
        else:  # every embedded platform of this machine, after the local sweep took down dead sessions' ones
            swept = janitor.sweep(older_than_s=older_than_s)
            running, unchecked = janitor.embedded_clusters_to_clean()
            for name, api in running:
                leftovers = janitor.orphaned_on_cluster(api, older_than_s=older_than_s)
                swept += [f"deleted {what} (platform {name})" for what in janitor.clean_on_cluster(api, leftovers)]
            for what in unchecked:
                print(f"rayproof: could not check {what}; bring it up, or take it down with `rayproof down "
                      f"--name`", file=sys.stderr)
    except BadInput as exc:
        print(f"rayproof: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    for line in swept:
        print(f"rayproof: {line}")
    if not swept:
        print("rayproof: nothing left behind by earlier runs" + (f" of run {run_id}" if run_id else ""))
    return 0


def _duration_s(text: str) -> float:
    """``90s``, ``30m``, ``2h`` or ``1d`` in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = text[:-1], text[-1:]
    if unit not in units or not number.replace(".", "", 1).isdigit():
        raise ValueError(f"--older-than {text!r}: give a number and a unit, s, m, h or d (for example 2h)")
    return float(number) * units[unit]


def sweep_ended_runs(api: Any) -> None:
    """certify's start: remove what runs whose lease expired left on the
    cluster (any host's), and say what was removed."""
    from fixtures import janitor

    for line in janitor.clean_on_cluster(api, janitor.orphaned_on_cluster(api)):
        print(f"rayproof: removed what an ended run left: {line}", flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    """Print benchmark figures (not pass/fail) with the machine they ran on."""
    import importlib

    return int(importlib.import_module(f"benchmarks.{args.name}").main(args.options))


def cmd_platform(args: argparse.Namespace) -> int:
    """Start, stop or describe the embedded Kubernetes platform."""
    from clusters.embedded import platform

    argv = [args.command, "--name", args.name]
    if args.profile:
        argv += ["--profile", args.profile]
    return platform.main(argv)


def cmd_version(args: argparse.Namespace) -> int:
    from rayproof import __version__

    print(f"rayproof {__version__}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayproof", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("certify", help=cmd_certify.__doc__, epilog=CERTIFY_EXITS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="report directory (default: out/certification-<UTC time>)")
    p.add_argument("-k", help="only clauses matching this pytest -k expression")
    p.add_argument("--kubeconfig", help="certify the existing cluster of this kubeconfig (default: the embedded platform)")
    p.add_argument("--context", help="kubeconfig context (default: its current context)")
    p.add_argument("--profile", help="certification profile YAML merged over core/profile.yaml")
    p.add_argument("--platform-name", help="embedded platform: its name (default: default)")
    p.add_argument("--platform-profile", help="embedded platform: its platform profile YAML")
    p.add_argument("--reveal-tenant-names", action="store_true",
                   help="record other tenants' Service and Ingress names in the evidence as they are (default: "
                        "hashed, sha256 of namespace/name, for a certificate meant to be published)")
    p.add_argument("--upgrade-to", metavar="VERSION",
                   help="certify, upgrade the KubeRay operator to VERSION while a RayService serves load and a RayJob "
                        "trains (UPG-1; on an existing cluster you upgrade it when asked), certify again and compare: "
                        "OUT/before, OUT/upgrade, OUT/after, OUT/comparison.txt and OUT/upgrade.md (with -k: "
                        "before and after of those clauses only, PARTIAL)")
    p.add_argument("--sign-key", metavar="KEY",
                   help="sign the evidence bundle with this PEM private key (Ed25519, ECDSA or RSA, unencrypted): "
                        "<bundle>.intoto.jsonl, an in-toto statement in a DSSE envelope naming the bundle's sha256 "
                        "and its certificate")
    p.set_defaults(func=cmd_certify)

    p = sub.add_parser("test", help=cmd_test.__doc__)
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments")
    p.set_defaults(func=cmd_test)

    p = sub.add_parser("report", help=cmd_report.__doc__)
    p.add_argument("results", help="results.json written by a certification run")
    p.add_argument("--out", help="where to write certification.{md,json,html} (default: beside results.json)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("verify", help=cmd_verify.__doc__, epilog=f"exit status: 0 verified, {VERIFY_FAILED_EXIT} "
                       f"does not verify (each problem printed; a damaged archive too), {BAD_INPUT_EXIT} not a bundle")
    p.add_argument("bundle", help="certification-<UTC time>.tar.gz written by certify")
    p.add_argument("--key", metavar="PUB", help="also check <bundle>.intoto.jsonl: signed with this PEM public key's "
                                                "private key, naming this bundle and the certificate its results make")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("export", help=cmd_export.__doc__, epilog=f"exit status: 0 written, {BAD_INPUT_EXIT} bad input "
                       "(not a bundle, a bundle that does not verify, an unknown checklist, --out not empty)")
    p.add_argument("program", choices=["cncf-ai"], help="cncf-ai: the Kubernetes AI Conformance program")
    p.add_argument("bundle", help="certification-<UTC time>.tar.gz written by certify (it must verify)")
    p.add_argument("--out", help="directory to write (default: cncf-ai-<bundle name>)")
    p.add_argument("--checklist", help="checklist version, e.g. v1.35 (default: the bundle's Kubernetes minor)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("compare", help=cmd_compare.__doc__, epilog=f"exit status: 0 no regression, "
                       f"{REGRESSION_EXIT} regressions (each flagged), {BAD_INPUT_EXIT} bad input")
    p.add_argument("old", help="the earlier certification: its bundle, report directory or certification.json")
    p.add_argument("new", help="the later certification, the same kinds")
    p.add_argument("--ranges", help="ranges file from `rayproof ranges` (without it figures are shown, not judged)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("ranges", help=cmd_ranges.__doc__)
    p.add_argument("certifications", nargs="+", help="bundles, report directories or certification.json files")
    p.add_argument("--out", default="ranges.yaml", help="where to write the ranges (default: ranges.yaml)")
    p.add_argument("--slack", type=float,
                   help="how far beyond a range's ends a figure may go, as a fraction of its magnitude (default 0.10, "
                        "or the --add-to file's)")
    p.add_argument("--add-to", metavar="RANGES",
                   help="widen this ranges file (made earlier) by the runs given, keeping its sources; the runs "
                        "must be of the platform at the same versions (comments in it are not kept)")
    p.set_defaults(func=cmd_ranges)

    p = sub.add_parser("clean", help=cmd_clean.__doc__, epilog=f"exit status: 0 done (what was removed is printed), "
                       f"{CLEAN_REFUSED_EXIT} --run names a live run, {BAD_INPUT_EXIT} bad input")
    p.add_argument("--kubeconfig", help="also clean this cluster (default: every embedded platform that runs, as "
                                        "its certifying identity; those that do not are named)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument("--run", metavar="ID", help="only this run's namespaces (the rayproof.io/run label), also where "
                                               "no owner can be judged; refused while the run's lease is renewed")
    p.add_argument("--older-than", metavar="AGE", help="also namespaces older than AGE (90s, 30m, 2h, 1d) whose "
                                                       "owner cannot be judged (made by an older rayproof)")
    p.add_argument("--platform-name", help="only this embedded platform (default: every one of this machine)")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("bench", help=cmd_bench.__doc__)
    p.add_argument("name", choices=["training", "certification", "interruptions", "nodes", "mutants"],
                   help="training: step, checkpoint and restart figures on a local Ray cluster; certification: "
                        "a certify run's wall time and where this machine's CPU went; interruptions: certify "
                        "interrupted N times at random points, and what each left after the next start's sweep; "
                        "nodes: the embedded platform's warm up and down times and its node layer's idle CPU and "
                        "memory; mutants: the kill matrix of the mutation catalogue (each one-change broken "
                        "reference platform against the clauses it must fail)")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="certification: certify's options (-k, --kubeconfig, --profile, ...); on the embedded "
                        "platform it also sets the run beside the retired node agent's last certification; "
                        "interruptions: --runs N, --seed S, -k EXPR; nodes: --runs N, --idle-s S; mutants: "
                        "--clause ID, --id ENTRY, --platform-profile FILE, --out DIR")
    p.set_defaults(func=cmd_bench)

    for name, text in (("up", "start the embedded Kubernetes platform (idempotent); prints the kubeconfig"),
                       ("down", "stop the embedded platform and remove everything it made"),
                       ("status", "show the embedded platform's processes and health")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--name", default="default", help="platform name (default: default)")
        p.add_argument("--profile", help="platform profile YAML (default: clusters/embedded/profile.yaml)")
        p.set_defaults(func=cmd_platform)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=cmd_version)

    # `test` hands every argument it does not know to pytest (`rayproof test -k ADM -x`).
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "test":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:
        args.pytest_args = [*unknown, *args.pytest_args]
    from_callers_directory(args)
    return args.func(args)


# Where the user ran `bin/rayproof`, which changes into the repository before it starts Python.
CALLER_CWD_ENV = "RAYPROOF_CALLER_CWD"
PATH_OPTIONS = ("kubeconfig", "profile", "platform_profile", "out", "results", "bundle", "old", "new", "ranges",
                "add_to", "certifications", "sign_key", "key")


def from_callers_directory(args: argparse.Namespace) -> None:
    """Relative paths the user passed are the user's: resolved against the
    directory ``bin/rayproof`` was run from, not the repository."""
    base = os.environ.get(CALLER_CWD_ENV)
    if not base:
        return

    def resolved(value: str) -> str:
        path = Path(value).expanduser()
        return value if path.is_absolute() else str(Path(base) / path)

    for name in PATH_OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, resolved(value))
        elif isinstance(value, list):
            setattr(args, name, [resolved(v) for v in value])
