"""The HTML certificate, read in a real headless browser (Debian's chromium,
run in a network namespace of its own so it can reach nothing): the verdict
and a fault clause's timeline are on the page as rendered, and the
timeline's marks are the figures of the clause's evidence."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

from PIL import Image

from reports import summary, timeline

CHROMIUM = shutil.which("chromium")
# A full-availability phase bar of a timeline (RdYlGn at 1.0); NOT CERTIFIED's badge.
BAR_GREEN, VERDICT_RED = (0x00, 0x68, 0x37), (0xCF, 0x22, 0x2E)

GCS1_EVIDENCE = {
    "figures": {"inject_to_oom_s": 16.8, "inject_to_nodes_back_s": 29.2, "inject_to_head_ready_s": 33.9,
                "inject_to_apps_running_s": 36.3},
    "availability_by_phase": {"inject_to_oom": {"seconds": 18, "availability": 1.0},
                              "oom_to_head_ready": {"seconds": 18, "availability": 0.97},
                              "head_ready_to_recovered": {"seconds": 4, "availability": 1.0},
                              "tail": {"seconds": 16, "availability": 1.0}},
}
RESULTS = {"started": 1.0, "finished": 400.0, "host": "runner", "exit_status": 1, "catalogue": ["GCS-1", "OPS-1"],
           "results": [{"nodeid": "g", "clause": "GCS-1", "must": "The head MUST recover.", "outcome": "passed",
                        "phase": "call", "duration_s": 150.0, "evidence": GCS1_EVIDENCE, "message": ""},
                       {"nodeid": "o", "clause": "OPS-1", "must": "Teardown MUST be quick.", "outcome": "failed",
                        "phase": "call", "duration_s": 70.0, "evidence": {"teardown_after_end_s": 91.0},
                        "message": "still there 91 s after the job ended"}]}


def _browse(page: Path, out: Path) -> tuple[str, Image.Image]:
    """The page's DOM as chromium built it, and a screenshot of it."""
    assert CHROMIUM, "this test needs Debian's chromium: bin/rayproof installs it when run as root"
    argv = ["unshare", "--net", CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
            "--hide-scrollbars", f"--user-data-dir={out / 'chromium-profile'}", "--window-size=1200,1400"]
    shot = out / "screenshot.png"
    subprocess.run([*argv, f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120)
    dom = subprocess.run([*argv, "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    return dom, Image.open(shot).convert("RGB")


def _pixels(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 8) -> int:
    return sum(count for count, rgb in image.getcolors(maxcolors=1 << 24)
               if all(abs(a - b) <= tolerance for a, b in zip(rgb, colour)))


def test_the_page_shows_the_verdict_and_a_timeline_drawn_from_the_evidence(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULTS))
    written = summary.write(results, {"runner": "runner"}, tmp_path)
    assert written["verdict"] == "NOT CERTIFIED"
    page = tmp_path / "certification.html"
    dom, shot = _browse(page, tmp_path)
    assert 'id="verdict"' in dom and ">NOT CERTIFIED</span>" in dom
    assert 'alt="GCS-1 timeline"' in dom and 'alt="OPS-1 timeline"' not in dom, "only fault clauses have one"
    marks = json.loads(dom.split('data-marks="')[1].split('"')[0].replace("&quot;", '"'))
    assert marks == {"head OOM-killed": 16.8, "Ray nodes back": 29.2, "head Ready again": 33.9,
                     "Serve apps RUNNING": 36.3}, "each mark is a figure of GCS-1's evidence"
    assert _pixels(shot, VERDICT_RED) > 500, "the verdict's badge is not painted"
    assert _pixels(shot, BAR_GREEN) > 50, "the timeline image is not painted"
    # The same page without its timeline image: the check above can fail.
    bare = tmp_path / "bare" / "certification.html"
    bare.parent.mkdir()
    bare.write_text(page.read_text().replace("data:image/png;base64,", "data:image/png;base64,AAAA"))
    assert _pixels(_browse(bare, bare.parent)[1], BAR_GREEN) == 0


def test_timelines_are_for_fault_clauses_with_their_figures_measured():
    assert timeline.of({"id": "GCS-1", "evidence": {}}) is None, "a clause that failed before measuring has none"
    assert timeline.of({"id": "OPS-1", "evidence": {"teardown_after_end_s": 3}}) is None
    adm4 = timeline.of({"id": "ADM-4", "evidence": {"bound_s": 180, "figures": {
        "evicted_after_admission_s": 121.5, "pods_gone_after_admission_s": 140.2,
        "quota_released_after_admission_s": 140.9, "requeued_after_eviction_s": 10.4}}})
    assert adm4.marks == [("evicted at the PodsReady timeout", 121.5), ("gang's pods gone", 140.2),
                          ("quota released", 140.9), ("requeued", 131.9)]
    assert adm4.bound == ("waitForPodsReady + slack", 180.0)
    assert timeline.png(adm4).startswith(b"\x89PNG")


SERIES_GREEN = (0x2C, 0xA0, 0x2C)  # matplotlib's tab:green, the first series


def test_a_timeline_draws_the_series_behind_its_figures():
    """GCS-1's availability each second, TRN-1's steps and checkpoints and
    ADM-4's gang each second are drawn on a second axis; rows with a missing
    value (a second without requests) are left out, not drawn as zero."""
    seconds = [[t, 1.0 if t < 17 or t > 30 else 0.5, 12.0] for t in range(-10, 56)] + [[56, None, None]]
    gcs1 = timeline.of({"id": "GCS-1", "evidence": {**GCS1_EVIDENCE, "availability_per_second": seconds}})
    assert gcs1.series[0][0] == "availability, each second" and len(gcs1.series[0][1]) == 66
    assert gcs1.series[0][1][0] == (-10.0, 1.0) and (20.0, 0.5) in gcs1.series[0][1]
    bare = timeline.of({"id": "GCS-1", "evidence": GCS1_EVIDENCE})
    drawn, undrawn = (Image.open(io.BytesIO(timeline.png(t))).convert("RGB") for t in (gcs1, bare))
    assert _pixels(drawn, SERIES_GREEN, 24) > 100 and _pixels(undrawn, SERIES_GREEN, 24) == 0
    trn1 = timeline.of({"id": "TRN-1", "evidence": {"kill_to_worker_group_restart_s": 41.0,
                                                    "steps_since_kill": [[-3.0, 11], [-1.0, 12], [44.0, 11]],
                                                    "checkpoints_since_kill": [[-2.0, 10]]}})
    assert dict(trn1.series) == {"training step": [(-3.0, 11.0), (-1.0, 12.0), (44.0, 11.0)],
                                 "checkpoint saved": [(-2.0, 10.0)]}
    adm4 = timeline.of({"id": "ADM-4", "evidence": {"figures": {"evicted_after_admission_s": 240.0},
                                                    "gang_per_second": [[0.0, 3, 0, 2], [241.0, 0, 3, 0]]}})
    assert dict(adm4.series)["GPUs reserved"] == [(0.0, 2.0), (241.0, 0.0)]


def test_allure_results_get_each_fault_clauses_timeline(tmp_path):
    """The Allure result allure-pytest wrote for a clause's test gets the
    clause's timeline, the PNG the certificate shows; other tests' results none."""
    import sys

    tests_dir = tmp_path / "suite" / "conformance" / "gcs"
    tests_dir.mkdir(parents=True)
    (tests_dir / "test_gcs.py").write_text("def test_head_oom_keeps_rayservice_available():\n    pass\n\n"
                                           "def test_other():\n    pass\n")
    allure_dir = tmp_path / "allure-results"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "allure_pytest",
                    f"--alluredir={allure_dir}", "conformance/gcs/test_gcs.py"],
                   cwd=tmp_path / "suite", check=True, capture_output=True, text=True)
    clauses = [{"id": "GCS-1", "evidence": GCS1_EVIDENCE,
                "test": "conformance/gcs/test_gcs.py::test_head_oom_keeps_rayservice_available"},
               {"id": "OPS-1", "evidence": {"teardown_after_end_s": 3.0}, "test": "conformance/gcs/test_gcs.py::test_other"}]

    assert timeline.attach_to_allure(allure_dir, clauses) == ["GCS-1"]

    results = {r["name"]: r for r in (json.loads(p.read_text()) for p in allure_dir.glob("*-result.json"))}
    attachments = results["test_head_oom_keeps_rayservice_available"]["attachments"]
    assert [a["name"] for a in attachments] == ["GCS-1 timeline"] and attachments[0]["type"] == "image/png"
    assert (allure_dir / attachments[0]["source"]).read_bytes() == timeline.png(timeline.of(clauses[0]))
    assert not results["test_other"].get("attachments")
    assert timeline.allure_full_name("conformance/a/test_b.py::test_c[p1]") == "conformance.a.test_b#test_c"
