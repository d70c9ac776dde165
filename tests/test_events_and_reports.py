from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from core.cost import record_idle_cost
from fixtures.events import EventLog, parse_events
from reports import summary
from workloads.fsdp_train import failure_reason


def test_events_found_behind_ray_prefixes_and_deduplicated(tmp_path):
    text = "\n".join([
        "INFO something else",
        '\x1b[36m(RayTrainWorker pid=1, ip=198.18.0.11)\x1b[0m RAYPROOF_EVENT {"event": "step", "step": 1, "ts": 1.0}',
        '\x1b[36m(RayTrainWorker pid=1, ip=198.18.0.11)\x1b[0m RAYPROOF_EVENT {"event": "step", "step": 1, "ts": 1.0}',
        'RAYPROOF_EVENT {"event": "finish", "step": 2, "ts": 2.0}',
        'RAYPROOF_EVENT {"event": "step", "st',  # cut by a crash
    ])
    assert [e["event"] for e in parse_events(text)] == ["step", "finish"]
    path = tmp_path / "run.log"
    path.write_text(text)
    assert EventLog(path).last("finish")["step"] == 2


def test_failure_reason_prefers_the_timeout_line():
    try:
        try:
            raise RuntimeError("Gloo connectFullMesh failed\n[pair.cc:152] timed out connecting: SO_ERROR")
        except RuntimeError as inner:
            raise ValueError("Training failed due to worker errors") from inner
    except ValueError as exc:
        reason = failure_reason(exc)
    assert "timed out connecting" in reason
    assert "\n" not in reason


def test_failure_reason_names_a_ranks_own_error_before_ray_trains_wrapper():
    class WorkerGroupError(RuntimeError):  # the shape of Ray Train V2's error
        def __init__(self, message, worker_failures):
            super().__init__(message)
            self.worker_failures = worker_failures

    storage = RuntimeError("Unable to set up cluster storage with the following settings:\nStorageContext<...>")
    reason = failure_reason(WorkerGroupError("Training failed due to worker errors:\n[Rank 1 Error Snippet]",
                                             {1: storage}))
    assert reason == "rank 1: RuntimeError: Unable to set up cluster storage with the following settings:", reason


def _results(*rows, catalogue=("X-1", "Y-1"), exit_status=0, overrides=None):
    return {"started": 100.0, "finished": 160.0, "host": "h", "results": list(rows), "exit_status": exit_status,
            "catalogue": list(catalogue), "timeout_overrides": overrides or {}}


def _row(clause, outcome="passed", phase="call", message=""):
    return {"nodeid": clause.lower(), "clause": clause, "must": f"{clause} MUST", "outcome": outcome, "phase": phase,
            "duration_s": 1, "evidence": {}, "message": message}


def test_summary_fails_certification_on_any_failed_or_errored_clause(tmp_path):
    rows = [
        {"nodeid": "a", "clause": "X-1", "must": "X MUST", "outcome": "passed", "phase": "call", "duration_s": 1,
         "evidence": {"s": 1}, "message": ""},
        {"nodeid": "a", "clause": "X-1", "must": "X MUST", "outcome": "error", "phase": "teardown", "duration_s": 1,
         "evidence": {}, "message": "cleanup failed"},
        {"nodeid": "b", "clause": "Y-1", "must": "Y MUST", "outcome": "not_applicable", "phase": "call",
         "duration_s": 0, "evidence": {}, "message": "not applicable: no policy engine"},
    ]
    built = summary.build(_results(*rows), {"platform": "test"})
    by_id = {c["id"]: c for c in built["clauses"]}
    assert by_id["X-1"]["outcome"] == summary.ERROR and by_id["X-1"]["message"] == "cleanup failed"
    assert by_id["Y-1"]["outcome"] == summary.NOT_APPLICABLE
    assert built["verdict"] == "NOT CERTIFIED"
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results(rows[0], rows[2])))
    written = summary.write(results, {"platform": "test"}, tmp_path)
    assert written["verdict"] == "CERTIFIED"
    md = (tmp_path / "certification.md").read_text()
    assert "| X-1 | pass |" in md and "not applicable" in md


def test_a_clause_that_could_not_start_for_a_busy_machine_makes_the_run_incomplete_not_a_failure():
    busy = {**_row("Y-1", "error", phase="setup", message="SharesNotFree: could not start"), "not_run": True}
    built = summary.build(_results(_row("X-1"), busy), {})
    assert built["verdict"] == summary.INCOMPLETE and built["verdict_reason"].startswith("Y-1 could not start")
    assert {c["id"]: c["outcome"] for c in built["clauses"]}["Y-1"] == summary.ERROR  # the table says it errored
    failed = summary.build(_results(_row("X-1", "failed", message="boom"), busy), {})
    assert failed["verdict"] == summary.NOT_CERTIFIED, "a clause that failed still decides"


def test_summary_with_no_clauses_is_not_certified():
    assert summary.build(_results(), {})["verdict"] == summary.PARTIAL
    assert summary.build(_results(catalogue=()), {})["verdict"] == summary.CERTIFIED


def test_a_subset_of_the_catalogue_is_partial_never_certified():
    built = summary.build(_results(_row("X-1")), {})
    assert built["verdict"] == summary.PARTIAL
    assert built["verdict_reason"] == "1 of 2 clauses run; not run: Y-1"


def test_a_failure_is_not_certified_even_in_a_subset():
    built = summary.build(_results(_row("X-1", "failed", message="boom")), {})
    assert built["verdict"] == summary.NOT_CERTIFIED
    assert built["verdict_reason"] == "X-1 did not pass (1 of 2 clauses run)"


def test_not_applicable_on_a_probe_the_runs_own_evidence_contradicts_is_never_certified():
    """NET-1 not applicable (no enforcement) beside NET-3 passing (enforced)
    happened once when each xdist worker probed on its own."""
    def probed(clause, outcome, enforced, probe_id="run/ns-1", key="network_policy_enforcement"):
        row = _row(clause, outcome)
        row["evidence"] = {key: {"enforced": enforced, "probe_id": probe_id}}
        return row

    catalogue = ("NET-1", "NET-3")
    built = summary.build(_results(probed("NET-1", "not_applicable", False), probed("NET-3", "passed", True, key="probe"),
                                   catalogue=catalogue), {})
    assert built["verdict"] == summary.INCOMPLETE and "NET-1 was called not applicable" in built["verdict_reason"]
    built = summary.build(_results(probed("NET-1", "not_applicable", False),
                                   probed("NET-3", "failed", False, "run/ns-2", key="probe"), catalogue=catalogue), {})
    assert built["verdict"] == summary.NOT_CERTIFIED  # NET-3 failed: that decides first
    consistent = summary.build(_results(probed("NET-1", "not_applicable", False),
                                        probed("NET-3", "passed", False, key="probe"), catalogue=catalogue), {})
    assert consistent["verdict"] == summary.CERTIFIED
    two_probes = summary.build(_results(probed("NET-1", "not_applicable", False),
                                        probed("NET-3", "passed", False, "run/ns-2", key="probe"),
                                        catalogue=catalogue), {})
    assert two_probes["verdict"] == summary.INCOMPLETE and "run/ns-1, run/ns-2" in two_probes["verdict_reason"]


def test_an_interrupted_run_is_incomplete_whatever_passed():
    built = summary.build(_results(_row("X-1"), _row("Y-1"), exit_status=2), {})
    assert built["verdict"] == summary.INCOMPLETE
    assert "interrupted" in built["verdict_reason"]
    # ...and so are results that cannot say which clauses a full run has.
    legacy = {k: v for k, v in _results(_row("X-1"), _row("Y-1")).items() if k != "catalogue"}
    assert summary.build(legacy, {})["verdict"] == summary.INCOMPLETE


def test_changed_bounds_are_non_default_and_printed_at_the_top(tmp_path):
    results = tmp_path / "results.json"
    payload = _results(_row("X-1"), _row("Y-1"), overrides={"RAYPROOF_TIMEOUT_TRAINING_RUN": "1200"})
    payload["profile_outside_ranges"] = ["serving.availabilityTarget = 0.5 is outside 0.99..1"]
    results.write_text(json.dumps(payload))
    written = summary.write(results, {}, tmp_path)
    assert written["verdict"] == summary.NON_DEFAULT
    head = (tmp_path / "certification.md").read_text().split("| platform |")[0]
    assert "# rayproof certification: NON-DEFAULT" in head
    assert "`RAYPROOF_TIMEOUT_TRAINING_RUN=1200`" in head and "serving.availabilityTarget = 0.5" in head


def test_collectives_in_flight_are_begun_and_not_ended_at_the_moment():
    from conformance.training_jobs import collectives_in_flight

    def span(phase, ts, rank, op="all_reduce", step=3):
        return {"event": "collective", "phase": phase, "ts": ts, "rank": rank, "op": op, "step": step}

    events = [span("begin", 10.0, 0, "forward_backward"), span("end", 10.2, 0, "forward_backward"),
              span("begin", 10.1, 1), span("begin", 10.9, 0), span("end", 11.0, 0), span("end", 11.0, 1),
              # the same step again after a restart: not the span the fault hit
              span("begin", 30.0, 1), span("end", 30.5, 1)]
    assert collectives_in_flight(events, 10.5) == [{"rank": 1, "op": "all_reduce", "step": 3, "began_s_before": 0.4}]
    assert collectives_in_flight(events, 11.5) == []
    assert collectives_in_flight(events, 9.0) == []


def test_the_newest_checkpoint_begun_is_bounded_by_the_moment_and_ignores_other_collectives():
    from conformance.training_jobs import newest_checkpoint_begun

    def span(phase, ts, op, step):
        return {"event": "collective", "phase": phase, "ts": ts, "rank": 0, "op": op, "step": step}

    events = [span("begin", 5.0, "checkpoint", 5), span("end", 5.5, "checkpoint", 5),
              span("begin", 10.0, "checkpoint", 10),  # begun, its pod deleted at 10.1, never ended
              span("begin", 11.0, "all_reduce", 11), {"event": "step", "ts": 11.0, "step": 11},
              span("begin", 20.0, "checkpoint", 15)]  # after the restart
    assert newest_checkpoint_begun(events, 15.0) == 10
    assert newest_checkpoint_begun(events, 7.0) == 5
    assert newest_checkpoint_begun(events, 5.0) is None  # strictly before


def test_the_collective_timeout_comes_from_the_platform_environment(monkeypatch):
    from workloads.fsdp_train import COLLECTIVE_TIMEOUT_ENV, parse_args

    base = ["--name", "r", "--storage-path", "/tmp/x"]
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    args = parse_args(base)
    assert (args.timeout_s, args.timeout_source) == (None, "Ray Train's default")
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "90")
    args = parse_args(base)
    assert (args.timeout_s, args.timeout_source) == (90, "$COLLECTIVE_TIMEOUT_S")
    args = parse_args([*base, "--timeout-s", "20"])
    assert (args.timeout_s, args.timeout_source) == (20, "--timeout-s")


def test_the_cost_of_each_failure_mode_is_summed_at_the_top_of_the_certificate(tmp_path):
    class Evidence:
        def __init__(self):
            self.values = {}

        def record(self, key, value):
            self.values[key] = value
            return value

    profile = {"cost": {"gpuHourPrice": 3.0, "currency": "USD"}}
    rows = []
    for clause, gpu_seconds, what in (("X-1", 1800.0, "a straggler"), ("Y-1", 5400.0, "a gang never Ready")):
        evidence = Evidence()
        record_idle_cost(profile, evidence, gpu_seconds, what)
        rows.append({**_row(clause), "evidence": evidence.values})
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results(*rows)))
    written = summary.write(results, {}, tmp_path)
    assert written["cost_per_incident"]["amount"] == 6.0 and written["cost_per_incident"]["gpu_hours"] == 2.0
    md = (tmp_path / "certification.md").read_text()
    assert ("**What these failure modes cost per incident on this platform:** 6.00 USD, 2 GPU-hours held "
            "without progress") in md
    assert "| Y-1 | a gang never Ready | 1.5 | 4.50 USD (at 3 per GPU-hour) |" in md
    assert md.index("cost per incident") < md.index("| clause | outcome |"), "the cost is at the top"
    assert summary.build(_results(_row("X-1")), {})["cost_per_incident"] == {
        "incidents": [], "gpu_hours": 0, "amount": None, "currency": None}


def test_promises_taken_on_trust_are_listed_at_the_top(tmp_path):
    row = _row("X-1")
    row["evidence"] = {"promises_taken_on_trust": ["kueue.waitForPodsReady: ConfigMap kueue-system/x could not be read"]}
    built = summary.build(_results(row, _row("Y-1")), {})
    assert built["taken_on_trust"] == ["kueue.waitForPodsReady: ConfigMap kueue-system/x could not be read"]
    assert "**Promises taken on trust**" in summary.to_markdown(built)
    assert "taken on trust" not in summary.to_markdown(summary.build(_results(_row("X-1"), _row("Y-1")), {}))


def test_the_killed_ranks_state_at_the_deletion():
    """TRN-1: inside the all-reduce at the kill, and a restarted group's rank
    running the same step again later does not count as the killed process ending it."""
    from conformance.training_jobs import rank_state_at

    def c(ts, phase, op="all_reduce", step=11, rank=1):
        return {"event": "collective", "ts": ts, "phase": phase, "op": op, "step": step, "rank": rank}

    killed = [c(1.0, "begin", "forward_backward"), c(1.2, "end", "forward_backward"), c(1.3, "begin"),
              {"event": "rank", "ts": 20.0, "rank": 1}, c(21.0, "begin", "forward_backward"),
              c(21.5, "end", "forward_backward"), c(21.6, "begin"), c(22.0, "end")]
    state = rank_state_at(killed, 1, at=2.0)
    assert (state["inside"], state["ended_after_s"], state["in_for_s"]) == ("all_reduce", None, 0.7)
    finished = [c(1.3, "begin"), c(2.5, "end"), c(2.6, "begin", "forward_backward")]
    assert rank_state_at(finished, 1, at=2.0)["ended_after_s"] == 0.5
    outside = [c(1.3, "begin"), c(1.5, "end"), c(1.6, "begin", "forward_backward"), c(2.5, "end", "forward_backward")]
    assert rank_state_at(outside, 1, at=1.55)["inside"] is None
    assert rank_state_at(outside, 0, at=2.0)["inside"] is None


def test_an_object_the_platforms_admission_refuses_fails_the_clause_in_one_line():
    import json as _json

    from kubernetes import client

    from fixtures.kube import refused_by_admission_as_failure

    def refuse(status, message):
        def create():
            raise client.ApiException(http_resp=SimpleNamespace(status=status, reason="Forbidden", headers={}, data=_json.dumps(
                {"message": message}).encode(), getheaders=lambda: {}))
        return create

    webhook = ('admission webhook "vrayjob.kb.io" denied the request: spec.shutdownAfterJobFinishes: Invalid value: '
               'false: a kueue managed job should delete the cluster after finishing')
    with pytest.raises(AssertionError, match=r"the platform refused the RayJob a/b made from .*vrayjob.kb.io"):
        refused_by_admission_as_failure(refuse(403, webhook), "RayJob a/b made from its golden template (x.yaml)")
    # A request the suite got wrong stays the suite's error.
    with pytest.raises(client.ApiException):
        refused_by_admission_as_failure(refuse(422, "RayJob.ray.io is invalid: spec.foo: unknown field"), "x")
