"""compare and ranges: outcome changes and figures outside the reference range
are regressions; figures inside it, wall-clock instants and healthy noise are not."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from clusters.embedded import build
from core.catalogue import catalogue
from rayproof import cli
from reports import bundle, compare, summary


def _certificate(recovery_s: float, availability: float = 0.999, outcome: str = "pass") -> dict:
    return {"verdict": "CERTIFIED" if outcome == "pass" else "NOT CERTIFIED", "clauses": [
        {"id": "GCS-1", "outcome": outcome, "duration_s": 150.0 + recovery_s, "evidence": {
            "figures": {"inject_to_head_ready_s": recovery_s, "oom_at": 1796245400.0 + recovery_s},
            "availability_window": {"availability": availability, "start": 1796245383.2 + recovery_s},
            "head_after": {"restarts": 1, "last_exit_code": 137}, "gcs_ft": True,
            "waited_for_host_slot_s": 40.0 + recovery_s}},
        {"id": "OPS-1", "outcome": "pass", "duration_s": 70.0, "evidence": {"teardown_after_end_s": 3.0}}]}


def _write(tmp_path: Path, name: str, certificate: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(certificate))
    return path


@pytest.fixture
def reference_ranges(tmp_path: Path) -> Path:
    runs = [_write(tmp_path, f"ref{i}.json", _certificate(recovery_s))
            for i, recovery_s in enumerate((31.0, 34.0, 29.5))]
    out = tmp_path / "ranges.yaml"
    assert cli.main(["ranges", *map(str, runs), "--out", str(out)]) == 0
    return out


def test_figures_are_numbers_of_the_evidence_without_wall_clock_instants_or_the_suites_queueing():
    found = compare.figures(_certificate(30.0)["clauses"][0])
    assert found == {"duration_s": 180.0, "figures.inject_to_head_ready_s": 30.0,
                     "availability_window.availability": 0.999, "head_after.restarts": 1.0,
                     "head_after.last_exit_code": 137.0}


def test_ranges_span_the_passed_runs(reference_ranges):
    ranges = yaml.safe_load(reference_ranges.read_text())
    assert ranges["runs"] == 3 and ranges["slack"] == compare.DEFAULT_SLACK
    assert ranges["clauses"]["GCS-1"]["figures.inject_to_head_ready_s"] == {"min": 29.5, "max": 34.0, "runs": 3}


def test_ranges_of_platforms_at_different_versions_are_refused(tmp_path, capsys):
    runs = []
    for i, kuberay in enumerate(("v1.5.0", "v1.6.0")):
        certificate = {**_certificate(31.0), "platform": {"versions": f"kubernetes v1.35.4, kuberay {kuberay}"}}
        runs.append(_write(tmp_path, f"run{i}.json", certificate))
    assert cli.main(["ranges", *map(str, runs), "--out", str(tmp_path / "ranges.yaml")]) == cli.BAD_INPUT_EXIT
    assert "platforms at different versions" in capsys.readouterr().err
    assert not (tmp_path / "ranges.yaml").exists()


def test_ranges_grow_run_by_run_and_count_each_run_once(tmp_path, reference_ranges, capsys):
    later = {**_certificate(40.0), "started": 1796400000.0}
    run = _write(tmp_path, "later.json", later)
    grown = tmp_path / "grown.yaml"
    assert cli.main(["ranges", str(run), "--add-to", str(reference_ranges), "--out", str(grown)]) == 0
    assert "from 4 runs" in capsys.readouterr().out
    ranges = yaml.safe_load(grown.read_text())
    assert ranges["runs"] == 4 and len(ranges["sources"]) == 4 and ranges["sources"][-1]["started"] == 1796400000.0
    assert ranges["clauses"]["GCS-1"]["figures.inject_to_head_ready_s"] == {"min": 29.5, "max": 40.0, "runs": 4}
    assert ranges["clauses"] == yaml.safe_load(reference_ranges.read_text())["clauses"] | ranges["clauses"]
    assert cli.main(["ranges", str(run), "--add-to", str(grown), "--out", str(tmp_path / "twice.yaml")]) == \
        cli.BAD_INPUT_EXIT
    assert "a run counts once" in capsys.readouterr().err
    other = _write(tmp_path, "other.json", {**later, "started": 1796500000.0,
                                             "platform": {"versions": "kubernetes v1.35.4, kuberay v1.6.0"}})
    assert cli.main(["ranges", str(other), "--add-to", str(grown), "--out", str(tmp_path / "mixed.yaml")]) == \
        cli.BAD_INPUT_EXIT
    assert "platforms at different versions" in capsys.readouterr().err
    assert not (tmp_path / "twice.yaml").exists() and not (tmp_path / "mixed.yaml").exists()


def test_a_run_inside_the_reference_range_is_no_regression(tmp_path, reference_ranges, capsys):
    old, new = _write(tmp_path, "old.json", _certificate(31.0)), _write(tmp_path, "new.json", _certificate(33.0))
    assert cli.main(["compare", str(old), str(new), "--ranges", str(reference_ranges)]) == 0
    out = capsys.readouterr().out
    assert "GCS-1    figures.inject_to_head_ready_s: 31.0 -> 33.0 (+2, +6.5%)" in out
    assert out.endswith("0 regressions\n")


def test_a_slower_recovery_is_flagged_on_its_clause(tmp_path, reference_ranges, capsys):
    old, slow = _write(tmp_path, "old.json", _certificate(31.0)), _write(tmp_path, "slow.json", _certificate(95.0))
    assert cli.main(["compare", str(old), str(slow), "--ranges", str(reference_ranges)]) == cli.REGRESSION_EXIT
    out = capsys.readouterr().out
    assert "figures.inject_to_head_ready_s: 31.0 -> 95.0 (+64, +206.5%)  REGRESSION: above the reference range " \
           "[29.5, 34] of 3 runs (slack 10%: at most 37.4)" in out
    assert out.endswith("1 regression: GCS-1 figures.inject_to_head_ready_s\n"), (
        "the clause's duration (the suite's own waits included) is shown, not judged")


def test_only_the_worse_direction_is_a_regression(tmp_path, reference_ranges, capsys):
    old = _write(tmp_path, "old.json", _certificate(31.0))
    faster = _certificate(5.0)
    faster["clauses"][0]["evidence"]["figures"]["head_p99_ms"] = 900.0  # a latency: shown, never judged
    assert cli.main(["compare", str(old), str(_write(tmp_path, "fast.json", faster)),
                     "--ranges", str(reference_ranges)]) == 0
    assert capsys.readouterr().out.endswith("0 regressions\n"), "a faster recovery is no regression"
    less_available = _write(tmp_path, "less.json", _certificate(31.0, availability=0.95))
    assert cli.main(["compare", str(old), str(less_available), "--ranges", str(reference_ranges)]) == \
        cli.REGRESSION_EXIT
    assert "availability_window.availability: 0.999 -> 0.95 (-0.049, -4.9%)  REGRESSION: below the reference " \
           "range [0.999, 0.999] of 3 runs" in capsys.readouterr().out


@pytest.mark.parametrize("name, worse", [
    ("figures.oom_to_head_ready_s", compare.HIGHER_IS_WORSE),
    ("b_admitted_at_s", compare.HIGHER_IS_WORSE),
    ("phases_s.B waits while A holds the gang", ""),
    ("experiment.duration_s", ""),
    ("availability_window_end.recovery_steps_s.head Ready", compare.HIGHER_IS_WORSE),
    ("ray_nodes.seconds_without_answer", compare.HIGHER_IS_WORSE),
    ("gang.requeues", compare.HIGHER_IS_WORSE),
    ("idle_gpu_cost.gpu_hours", compare.HIGHER_IS_WORSE),
    ("availability_window.availability", compare.LOWER_IS_WORSE),
    ("availability_window.worst_second_p99_ms", ""),
    ("availability_window.sent", ""),
    ("promised_fail_fast_bound_s", ""),
    ("wait_for_pods_ready.timeout_s", ""),
    ("duration_s", ""),
])
def test_which_way_a_figure_gets_worse_is_read_from_its_name(name, worse):
    assert compare.worse_when(name) == worse


def test_an_outcome_that_got_worse_is_a_regression_without_ranges(tmp_path, capsys):
    old = _write(tmp_path, "old.json", _certificate(31.0))
    failed = _write(tmp_path, "failed.json", _certificate(31.0, outcome="fail"))
    assert cli.main(["compare", str(old), str(failed)]) == cli.REGRESSION_EXIT
    out = capsys.readouterr().out
    assert "GCS-1    outcome: pass -> fail  REGRESSION: the outcome got worse" in out and "figures not judged" in out
    assert cli.main(["compare", str(failed), str(old)]) == 0, "a clause that recovered is no regression"


def test_compare_reads_bundles_and_refuses_one_that_does_not_verify(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    results = {"started": 1.0, "finished": 2.0, "host": "h", "exit_status": 0, "catalogue": ["T-1"],
               "results": [{"nodeid": "n", "clause": "T-1", "must": "MUST", "outcome": "passed", "phase": "call",
                            "duration_s": 5.0, "evidence": {"recovery_s": 12.0}, "message": ""}]}
    (out / "results.json").write_text(json.dumps(results))
    summary.write(out / "results.json", {"runner": "h"}, out)
    archive = bundle.write(out, profile_yaml="{}\n", templates={}, versions={}).rename(tmp_path / "good.tar.gz")
    assert compare.load(archive)["clauses"][0]["evidence"] == {"recovery_s": 12.0}
    tampered = copy.deepcopy(json.loads((out / "certification.json").read_text()))
    tampered["clauses"][0]["evidence"]["recovery_s"] = 1.0
    (out / "certification.json").write_text(json.dumps(tampered, indent=2))
    forged = bundle.write(out, profile_yaml="{}\n", templates={}, versions={})  # manifest recomputed over the edit
    assert cli.main(["compare", str(archive), str(forged)]) == cli.BAD_INPUT_EXIT
    assert "does not verify (certification.json is not the certificate its results.json makes" \
        in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "none"), str(archive)]) == cli.BAD_INPUT_EXIT


REFERENCE_RANGES = Path(__file__).resolve().parents[1] / "clusters" / "embedded" / "ranges.yaml"


def test_the_shipped_reference_ranges_are_of_the_platform_as_pinned():
    """A change of a pinned version makes the shipped ranges another platform's: remake them
    (`bin/rayproof ranges` over certifications of the new pins)."""
    ranges = compare.load_ranges(REFERENCE_RANGES)
    assert ranges["runs"] >= 2 and len(ranges["sources"]) == ranges["runs"]
    for source in ranges["sources"]:
        assert source["verdict"] == "CERTIFIED", source
        for name, version in build.pinned_versions().items():
            assert f"{name} {version}" in source["versions"], (name, version, source["versions"])
    assert set(ranges["clauses"]) == set(catalogue()) - {cli.UPGRADE_CLAUSE}, "every clause a certification runs"


def test_the_shipped_reference_ranges_still_flag_the_measured_slower_recovery():
    """The mutation measured on 2026-12-04 (the golden RayService's head waits 60 s for readiness:
    GCS-1's oom_to_head_ready_s 61.1 s) stays a regression as runs widen the shipped ranges and their
    slack is set; a run at the top of the healthy runs' range stays none."""
    ranges = compare.load_ranges(REFERENCE_RANGES)
    healthy = ranges["clauses"]["GCS-1"]["figures.oom_to_head_ready_s"]

    def run(oom_to_head_ready_s: float) -> dict:
        return {"verdict": "CERTIFIED", "clauses": [{"id": "GCS-1", "outcome": "pass", "duration_s": 150.0,
                                                      "evidence": {"figures": {
                                                          "oom_to_head_ready_s": oom_to_head_ready_s}}}]}

    slower = compare.compare(run(healthy["min"]), run(61.1), ranges).regressions
    assert [(c.clause, c.what) for c in slower] == [("GCS-1", "figures.oom_to_head_ready_s")], (healthy, slower)
    assert not compare.compare(run(healthy["min"]), run(healthy["max"]), ranges).regressions


def test_figures_of_objects_with_generated_names_are_combined_into_the_worst():
    """Pods of a RayCluster or a Job have names Kubernetes generated, other ones in every run: their
    figures are compared as the worst of them, under ``*`` (a name chosen by a person is kept)."""
    clause = {"id": "GCS-2", "outcome": "pass", "duration_s": 90.0, "evidence": {
        "team_b_pods_after": {"team-b-6eeb-dxtpm-head-6fgv9": {"restarts": 0},
                              "team-b-6eeb-dxtpm-workers-worker-7zbpx": {"restarts": 2},
                              "team-b-994c-6jnhh": {"restarts": 1}, "gcs-redis": {"restarts": 0}},
        "gang_created_to_ready_s": {"late-269c-75rpj-head-m67cx": 10.0, "late-269c-75rpj-straggler-worker-cvbxp": 44.0},
        "replicas": {"serve-q88f8": {"availability": 0.97}, "serve-b8w8k": {"availability": 1.0}}}}
    assert compare.figures(clause) == {
        "duration_s": 90.0, "team_b_pods_after.*.restarts": 2.0, "team_b_pods_after.gcs-redis.restarts": 0.0,
        "gang_created_to_ready_s.*": 44.0, "replicas.*.availability": 0.97}
