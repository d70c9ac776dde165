"""`certify --upgrade-to VERSION`: before, the upgrade under load (UPG-1), after,
compared; and the inputs it refuses. The certifications here are pytest runs
faked at their results (what the clauses measure is theirs to test); the
embedded platform's upgrade itself is UPG-1's, run by `certify --upgrade-to`."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from clusters.embedded import build
from core.catalogue import catalogue
from rayproof import cli


class FakeTarget:
    kind = "embedded"

    def __init__(self) -> None:
        self.version = "v1.5.0"
        self.prepared: list[str] = []
        self.argvs: list[list[str]] = []
        self.closed = False

    def describe(self) -> dict[str, Any]:
        return {"server": "https://127.0.0.1:1", "versions": {"kubernetes": "v1.35.4", "kuberay": self.version},
                "nodes": 4, "node_shapes": {}}

    def prepare_kuberay_upgrade(self, version: str, progress: Any = print) -> None:
        self.prepared.append(version)

    def close(self) -> None:
        self.closed = True


def fake_pytest(target: FakeTarget, upgrade_outcome: str, failing_after: str | None = None):
    """A pytest run writing the results a certification (or the UPG-1 run) would."""
    def run(args: list[str]) -> int:
        target.argvs.append(args)
        results = Path(next(a for a in args if a.startswith("--rayproof-results=")).split("=", 1)[1])
        upgrading = "--upgrade-to" in args
        selected = ""  # pytest's -k: the last one given
        for flag, value in zip(args, args[1:]):
            if flag == "-k":
                selected = value
        rows = []
        for cid in catalogue():
            if selected not in cid:
                continue
            outcome = "passed"
            if cid == cli.UPGRADE_CLAUSE:
                outcome = upgrade_outcome if upgrading else "not_applicable"
            elif failing_after == cid and target.version != "v1.5.0":
                outcome = "failed"
            rows.append({"nodeid": f"conformance/x.py::test_{cid}", "clause": cid, "must": "It MUST.",
                         "outcome": outcome, "phase": "call", "duration_s": 1.0,
                         "evidence": {"figures": {"upgrade_s": 41.0, "failed_requests": 0}} if upgrading else {},
                         "message": "" if outcome == "passed" else f"{cid} {outcome}"})
        if upgrading and upgrade_outcome == "passed":
            target.version = args[args.index("--upgrade-to") + 1]
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps({"started": time.time() - 5, "finished": time.time(), "exit_status": 0,
                                       "host": "h", "catalogue": catalogue(), "timeout_overrides": {},
                                       "profile_outside_ranges": [], "results": rows}))
        return 0
    return run


@pytest.fixture
def upgrade_run(monkeypatch, tmp_path):
    target = FakeTarget()
    monkeypatch.setattr(cli, "_open_certified_cluster", lambda args, profile: target)
    monkeypatch.setattr(cli, "runner_rows", lambda: {"runner": "test"})
    monkeypatch.setattr(build, "kuberay_upgrade_versions", lambda: ["v1.6.0"])

    def run(upgrade_outcome: str = "passed", failing_after: str | None = None,
            options: tuple[str, ...] = ()) -> tuple[int, Path]:
        monkeypatch.setattr(cli, "_pytest", fake_pytest(target, upgrade_outcome, failing_after))
        out = tmp_path / "out"
        return cli.main(["certify", "--upgrade-to", "v1.6.0", "--out", str(out), *options]), out
    run.target = target  # type: ignore[attr-defined]
    run.argvs = target.argvs  # type: ignore[attr-defined]
    return run


def test_an_upgrade_certification_certifies_upgrades_under_load_certifies_again_and_compares(upgrade_run) -> None:
    rc, out = upgrade_run()
    assert rc == cli.CERTIFIED_EXIT
    upgrade_argv = upgrade_run.argvs[1]
    assert upgrade_argv[-7:] == ["-n", "1", "-s", "-k", "UPG-1", "--upgrade-to", "v1.6.0"], (
        "the upgrade runs alone, its output uncaptured, where a person is told when to upgrade")
    assert upgrade_run.target.prepared == ["v1.6.0"] and upgrade_run.target.closed
    for phase in ("before", "upgrade", "after"):
        assert (out / phase / "certification.json").is_file(), phase
    before = json.loads((out / "before" / "certification.json").read_text())
    after = json.loads((out / "after" / "certification.json").read_text())
    assert before["verdict"] == after["verdict"] == "CERTIFIED"
    assert {c["id"]: c["outcome"] for c in before["clauses"]}[cli.UPGRADE_CLAUSE] == "not applicable"
    page = (out / "upgrade.md").read_text()
    assert "KubeRay v1.5.0 -> v1.6.0" in page and "UPG-1, the upgrade under load: passed" in page
    assert "upgrade s: 41.0" in page and "0 regressions" in (out / "comparison.txt").read_text()


def test_a_clause_that_fails_only_after_the_upgrade_is_a_regression(upgrade_run) -> None:
    rc, out = upgrade_run(failing_after="OPS-1")
    assert rc == cli.NOT_CERTIFIED_EXIT
    assert "OPS-1 outcome" in (out / "comparison.txt").read_text()


def test_a_failed_upgrade_is_not_certified_and_the_platform_not_certified_again(upgrade_run) -> None:
    rc, out = upgrade_run(upgrade_outcome="failed")
    assert rc == cli.NOT_CERTIFIED_EXIT
    assert not (out / "after").exists()
    assert "UPG-1, the upgrade under load: failed" in (out / "upgrade.md").read_text()


def test_an_upgrade_certification_of_some_clauses_is_partial_and_still_runs_the_upgrade(upgrade_run) -> None:
    rc, out = upgrade_run(options=("-k", "TRN-2"))
    assert rc == cli.NO_VERDICT_EXIT
    before, upgrade, after = upgrade_run.argvs
    assert before[-2:] == after[-2:] == ["-k", "TRN-2"]
    assert upgrade[-7:] == ["-n", "1", "-s", "-k", "UPG-1", "--upgrade-to", "v1.6.0"], "pytest takes the last -k"
    for phase in ("before", "after"):
        page = json.loads((out / phase / "certification.json").read_text())
        assert page["verdict"] == "PARTIAL" and [c["id"] for c in page["clauses"]] == ["TRN-2"], phase
    assert "UPG-1, the upgrade under load: passed" in (out / "upgrade.md").read_text()


@pytest.mark.parametrize(("argv", "says"), [
    (["--upgrade-to", "1.6"], "looks like v1.6.0"),
    (["--upgrade-to", "v9.9.9"], "can be upgraded to v1.6.0"),
])
def test_an_upgrade_target_that_cannot_be_had_is_bad_input_and_creates_nothing(monkeypatch, tmp_path, capsys,
                                                                                argv, says) -> None:
    monkeypatch.setattr(build, "kuberay_upgrade_versions", lambda: ["v1.6.0"])
    monkeypatch.setattr(cli, "_open_certified_cluster", lambda *a: pytest.fail("nothing may be reached"))
    assert cli.main(["certify", *argv, "--out", str(tmp_path / "out")]) == cli.BAD_INPUT_EXIT
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_upgrade_to_the_version_the_operator_runs_is_bad_input(upgrade_run, capsys) -> None:
    upgrade_run.target.version = "v1.6.0"
    rc, out = upgrade_run()
    assert rc == cli.BAD_INPUT_EXIT and "already runs it; nothing to upgrade" in capsys.readouterr().err
    assert upgrade_run.argvs == [] and upgrade_run.target.closed and not out.exists()


def test_the_embedded_platform_can_be_upgraded_to_the_locked_kuberay_versions(monkeypatch, tmp_path) -> None:
    assert "v1.6.0" in build.kuberay_upgrade_versions()
    with pytest.raises(ValueError, match="not an upgrade target"):
        build.ensure_kuberay_built("v0.0.1")
    # The pinned version is the platform's own build: an "upgrade" to it redeploys the operator (UPG-1's self-test).
    own = {"kuberay-operator": tmp_path / "kuberay-operator", "manifests": tmp_path / "manifests"}
    monkeypatch.setattr(build, "ensure_built", lambda progress=print: own)
    pinned = build.load_versions()["kuberay"]["version"]
    assert build.ensure_kuberay_built(pinned) == {"kuberay-operator": own["kuberay-operator"],
                                                 "crds": own["manifests"] / "kuberay" / "crd"}
