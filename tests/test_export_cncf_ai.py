"""`rayproof export cncf-ai BUNDLE`: the Kubernetes AI Conformance entries a
verified bundle evidences, each pointing at its JUnit cases, and a
version-stamped e2e.log; no claim where a clause failed or did not run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rayproof import cli
from reports import bundle, cncf_ai, summary

ADMISSION = "conformance/admission/test_admission.py::test_{}"
TRAINING = "conformance/training/test_recovery.py::test_{}"


def _row(nodeid: str, clause: str, outcome: str = "passed") -> dict:
    return {"nodeid": nodeid, "clause": clause, "must": f"MUST {clause}", "outcome": outcome, "phase": "call",
            "duration_s": 61.5, "evidence": {}, "message": "" if outcome == "passed" else "AssertionError: x"}


def _bundle(tmp_path: Path, rows: list[dict], kubernetes: str = "v1.35.4") -> Path:
    results = {"started": 1796250000.0, "finished": 1796251000.0, "host": "runner-1", "exit_status": 0,
               "catalogue": sorted({r["clause"] for r in rows}), "timeout_overrides": {}, "profile_outside_ranges": [],
               "results": rows,
               "target": {"versions": {"kubernetes": kubernetes, "kuberay": "v1.5.0", "kueue": "v0.17.0"}}}
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))
    (out / "junit.xml").write_text("<testsuites><testsuite name='pytest'/></testsuites>\n")
    summary.write(out / "results.json", {"runner": "the host that ran the suite"}, out)
    return bundle.write(out, profile_yaml="{}\n", templates={},
                        versions=bundle.versions(results["target"], {"ray": "2.60.0", "torch": "2.15.0"}, tmp_path))


ALL_PASSED = [*[_row(ADMISSION.format(f"adm{i}"), f"ADM-{i}") for i in range(1, 6)],
              *[_row(TRAINING.format(c.lower().replace("-", "")), c) for c in ("TRN-1", "TRN-2")],
              _row("conformance/gcs/test_gcs.py::test_gcs1", "GCS-1"), _row("conformance/gcs/test_gcs.py::test_gcs2", "GCS-2"),
              _row("conformance/operations/test_operations.py::test_ops1", "OPS-1"),
              _row("conformance/network/test_network.py::test_net1", "NET-1")]


def _entries(product: dict) -> dict[str, dict]:
    return {e["id"]: e for section in product["spec"].values() for e in section}


def test_every_clause_passed_claims_the_two_covered_entries_and_lists_the_rest(tmp_path, capsys):
    archive = _bundle(tmp_path, ALL_PASSED)
    out = tmp_path / "export"
    assert cli.main(["export", "cncf-ai", str(archive), "--out", str(out)]) == 0
    product = yaml.safe_load((out / "PRODUCT.yaml").read_text())
    assert product["metadata"]["kubernetesVersion"] == "v1.35"
    entries = _entries(product)
    assert set(entries) == {rid for section in cncf_ai.CHECKLISTS["v1.35"].values() for rid, _ in section}
    gang = entries["gang_scheduling"]
    assert gang["status"] == "Implemented" and gang["level"] == "MUST"
    assert "file://results/junit.xml#conformance.admission.test_admission.test_adm3" in gang["evidence"]
    assert "file://results/e2e.log" in gang["evidence"] and "Kueue v0.17.0" in gang["notes"]
    controller = entries["robust_controller"]
    assert controller["status"] == "Implemented" and "KubeRay operator v1.5.0" in controller["notes"]
    assert "file://results/junit.xml#conformance.gcs.test_gcs.test_gcs1" in controller["evidence"]
    uncovered = [e for rid, e in entries.items() if rid not in cncf_ai.COVERED]
    assert uncovered and all(e["status"] == "" and e["evidence"] == [] and e["notes"].startswith("not covered")
                             for e in uncovered)
    assert (out / "results" / "junit.xml").read_bytes() == (tmp_path / "run" / "junit.xml").read_bytes()
    log = (out / "results" / "e2e.log").read_text().splitlines()
    assert "checklist v1.35" in log[0] and log[1] == f"bundle {archive.name} sha256 {bundle.sha256_of(archive)}"
    assert log[2] == "verdict CERTIFIED" and "kuberay v1.5.0" in log[3] and "torch 2.15.0" in log[4]
    assert any(line.startswith("PASSED  ADM-3  gang_scheduling") for line in log)
    assert any(line.startswith("PASSED  NET-1  -") for line in log)
    assert "gang_scheduling: Implemented" in capsys.readouterr().out


def test_a_failed_or_missing_clause_leaves_the_entry_without_a_claim(tmp_path):
    rows = [r if r["clause"] != "ADM-4" else _row(r["nodeid"], "ADM-4", "failed")
            for r in ALL_PASSED if r["clause"] != "OPS-1"]
    entries = _entries(cncf_ai.build(_bundle(tmp_path, rows)).product)
    assert entries["gang_scheduling"]["status"] == "" and "failed: ADM-4" in entries["gang_scheduling"]["notes"]
    assert entries["robust_controller"]["status"] == ""
    assert "did not run: OPS-1" in entries["robust_controller"]["notes"]


def test_a_bundle_that_does_not_verify_is_not_exported(tmp_path, capsys):
    archive = _bundle(tmp_path, ALL_PASSED)
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(bytes(data))
    out = tmp_path / "export"
    assert cli.main(["export", "cncf-ai", str(broken), "--out", str(out)]) == cli.BAD_INPUT_EXIT
    assert not out.exists() and "rayproof:" in capsys.readouterr().err


def test_an_unknown_checklist_version_is_bad_input_naming_the_known_ones(tmp_path, capsys):
    archive = _bundle(tmp_path, ALL_PASSED, kubernetes="v1.31.2")
    assert cli.main(["export", "cncf-ai", str(archive), "--out", str(tmp_path / "x")]) == cli.BAD_INPUT_EXIT
    assert "v1.31" in capsys.readouterr().err
    with pytest.raises(cncf_ai.ExportError, match="v1.35, v1.37"):
        cncf_ai.build(archive)
    assert cncf_ai.build(archive, "v1.37").product["metadata"]["kubernetesVersion"] == "v1.37"


def test_an_out_that_is_a_file_or_not_empty_is_bad_input(tmp_path, capsys):
    archive = _bundle(tmp_path, ALL_PASSED)
    taken = tmp_path / "taken"
    taken.write_text("x\n")
    assert cli.main(["export", "cncf-ai", str(archive), "--out", str(taken)]) == cli.BAD_INPUT_EXIT
    assert taken.read_text() == "x\n" and "not an empty directory" in capsys.readouterr().err
