"""The mutation catalogue: every entry fits the reference platform, and the kill matrix is read as stated."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from benchmarks import mutants
from clusters.embedded import mutations
from clusters.embedded.mutations import CatalogueError, apply_edit
from core.catalogue import catalogue, clause_tests


def test_every_entry_loads_and_names_clauses_of_the_catalogue():
    entries = mutations.load()
    assert len({m.id for m in entries}) == len(entries)
    assert {c for m in entries for c in m.clauses} <= set(catalogue())
    assert all(m.summary and all(m.expect.values()) for m in entries), "an entry without a summary or a cause"


def test_each_clause_has_at_most_one_self_test_entry():
    owners: dict[str, list[str]] = {}
    for m in mutations.load():
        for clause in m.selftest:
            owners.setdefault(clause, []).append(m.id)
    assert {c: ids for c, ids in owners.items() if len(ids) > 1} == {}


def test_clause_tests_are_the_collected_clause_functions():
    tests = clause_tests()
    assert sorted(tests) == catalogue()
    assert tests["NET-2"] == "conformance/network/test_network.py::test_platform_worker_policy_lets_training_run"


def test_template_edits_change_only_what_they_name():
    m = mutations.entry("collective-timeout-left-at-ray-trains-default")
    name, obj = m.template()
    original = yaml.safe_load((mutations.GOLDEN / "rayjob.yaml").read_text())
    envs = [c["env"] for g in (obj["spec"]["rayClusterSpec"]["headGroupSpec"],
                               *obj["spec"]["rayClusterSpec"]["workerGroupSpecs"])
            for c in g["template"]["spec"]["containers"]]
    assert name == "rayJob" and envs and all("COLLECTIVE_TIMEOUT_S" not in {e["name"] for e in env} for env in envs)
    assert all("RAY_USAGE_STATS_ENABLED" in {e["name"] for e in env} for env in envs)
    for spec in (obj, original):  # the rest is the reference template as it was
        for g in (spec["spec"]["rayClusterSpec"]["headGroupSpec"], *spec["spec"]["rayClusterSpec"]["workerGroupSpecs"]):
            for c in g["template"]["spec"]["containers"]:
                c.pop("env")
    assert obj == original


def test_onboarding_edits_and_deletions():
    docs = mutations.entry("heads-left-open-to-other-namespaces").onboarding_class()
    assert "ray-head-isolation" not in {d["metadata"]["name"] for d in docs}
    docs = mutations.entry("worker-policy-admits-everything").onboarding_class()
    assert next(d for d in docs if d["metadata"]["name"] == "ray-workers")["spec"]["ingress"] == [{}]
    docs = mutations.entry("queues-never-preempt").onboarding_class()
    assert next(d for d in docs if d["kind"] == "ClusterQueue")["spec"]["preemption"]["withinClusterQueue"] == "Never"


def test_an_edit_that_matches_nothing_is_an_error():
    obj = {"kind": "RayCluster", "spec": {"workerGroupSpecs": [{"name": "a"}]}}
    with pytest.raises(CatalogueError, match="matches nothing"):
        apply_edit(copy.deepcopy(obj), {"remove": "spec.workerGroupSpecs[name=b]"}, what="test")
    with pytest.raises(CatalogueError, match="matches nothing"):
        apply_edit(copy.deepcopy(obj), {"remove": "cluster.headGroupSpec.serviceType"}, what="test")
    changed = copy.deepcopy(obj)
    apply_edit(changed, {"set": "spec.workerGroupSpecs[0].replicas", "value": 3}, what="test")
    assert changed["spec"]["workerGroupSpecs"] == [{"name": "a", "replicas": 3}]


def test_append_adds_to_the_end_of_a_list_and_needs_one():
    obj = {"spec": {"ingress": [{"from": []}], "podSelector": {}}}
    apply_edit(obj, {"append": "spec.ingress", "value": {"ports": [10001]}}, what="test")
    assert obj["spec"]["ingress"] == [{"from": []}, {"ports": [10001]}]
    for path in ("spec.egress", "spec.podSelector"):  # missing, or not a list
        with pytest.raises(CatalogueError, match="matches nothing"):
            apply_edit(obj, {"append": path, "value": {}}, what="test")


def test_a_catalogue_that_does_not_fit_is_refused(tmp_path):
    bad = tmp_path / "catalogue.yaml"
    bad.write_text(yaml.safe_dump([{"id": "x", "summary": "s", "expect": {"NOPE-1": "c"},
                                    "change": {"profile": {"a": 1}}}]))
    with pytest.raises(CatalogueError, match="NOPE-1"):
        mutations.load(bad)
    bad.write_text(yaml.safe_dump([{"id": "x", "summary": "s", "expect": {"SEC-1": "c"},
                                    "change": {"template": "rayCluster", "profile": {}, "edits": []}}]))
    with pytest.raises(CatalogueError, match="change must be one of"):
        mutations.load(bad)


@pytest.mark.parametrize(("outcome", "message", "expected"), [
    ("failed", "the workers accept connections from other namespaces", mutants.KILLED),
    ("failed", "the driver did not start", mutants.OTHER_CAUSE),
    ("error", "accept connections from other namespaces", mutants.OTHER_CAUSE),
    ("passed", "", mutants.SURVIVED),
    ("not_applicable", "the cluster does not enforce", mutants.SURVIVED),
])
def test_verdict(outcome, message, expected):
    assert mutants.verdict({"outcome": outcome, "message": message},
                           ("accept connections from other namespaces",)) == expected


def test_matrix_counts_kills_and_survivors():
    rows = [{"mutation": "a", "clause": "NET-2", "verdict": mutants.KILLED, "seconds": 10.0},
            {"mutation": "b", "clause": "SEC-1", "verdict": mutants.SURVIVED, "seconds": 5.0}]
    table = mutants.matrix(rows)
    assert "kill rate 1/2 (50%)" in table and "1 survived" in table and "SURVIVED" in table, table


def test_bench_mutants_refuses_bad_input_before_starting_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mutants.main(["--clause", "NOPE-9", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "NOPE-9" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(SystemExit) as exc:
        mutants.main(["--id", "queues-never-preempt", "--out", str(tmp_path / "full")])
    assert exc.value.code == 2 and not (tmp_path / "o").exists()
    json.dumps(mutants.matrix([]))  # an empty run still prints a matrix


def test_plan_shares_one_platform_and_gives_each_platform_change_its_own():
    entries = {m.id: m for m in mutations.load()}
    chosen = [(entries["queues-never-preempt"], "ADM-5"), (entries["kueue-does-not-manage-rayjobs"], "ADM-1"),
              (entries["kueue-does-not-manage-rayjobs"], "ADM-2"), (entries["cni-enforces-no-networkpolicy"], "NET-3")]
    shared, own = mutants.plan(chosen)
    assert [(m.id, c) for m, c in shared] == [("queues-never-preempt", "ADM-5")]
    assert [(m.id, [c for _, c in rows]) for m, rows in own] == [("kueue-does-not-manage-rayjobs", ["ADM-1", "ADM-2"]),
                                                                 ("cni-enforces-no-networkpolicy", ["NET-3"])]


def test_bench_mutants_refuses_a_platform_profile_it_cannot_read(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mutants.main(["--id", "queues-never-preempt", "--platform-profile", str(tmp_path / "none.yaml"),
                      "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "none.yaml" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_bench_mutants_refuses_fewer_than_one_job(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mutants.main(["--id", "queues-never-preempt", "--jobs", "0", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "--jobs" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_upg1_runs_with_an_upgrade_to_the_version_the_platform_runs():
    from clusters.embedded import build

    assert mutants.clause_options("UPG-1") == ("--upgrade-to", build.load_versions()["kuberay"]["version"])
    assert mutants.clause_options("NET-2") == ()


def _row(entry, clause, suite, *, verdict=mutants.KILLED, interrupted=False):
    return {"mutation": entry.id, "clause": clause, "verdict": verdict, "outcome": "failed", "seconds": 1.0,
            "message": "m", "causes": [], "suite": suite, "entry": entry.digest(), "interrupted": interrupted}


def test_resume_keeps_the_rows_of_this_suite_and_entry_version_and_drops_the_rest(tmp_path):
    entries = {m.id: m for m in mutations.load()}
    never, gpu = entries["queues-never-preempt"], entries["gpu-quota-not-tied-to-the-tenant"]
    changed = mutations.Mutation(**{**gpu.__dict__, "expect": {**gpu.expect, "ADM-1": ("another cause",)}})
    lines = [json.dumps(_row(never, "ADM-5", "S")),
             json.dumps(_row(gpu, "ADM-1", "older suite")),  # measured with other clauses or faults
             json.dumps(_row(changed, "ADM-2", "S")),  # measured under another version of the entry
             json.dumps(_row(gpu, "ADM-5", "S", interrupted=True)),  # a Ctrl-C, not a verdict
             '{"mutation": "queues-never-pre']  # cut short by a killed run
    (tmp_path / mutants.ROWS).write_text("\n".join(lines) + "\n")
    chosen = {("queues-never-preempt", "ADM-5"), ("gpu-quota-not-tied-to-the-tenant", "ADM-1"),
              ("gpu-quota-not-tied-to-the-tenant", "ADM-2"), ("gpu-quota-not-tied-to-the-tenant", "ADM-5")}
    kept, dropped = mutants.resumed_rows(tmp_path, "S", entries, chosen)
    assert [(r["mutation"], r["clause"]) for r in kept] == [("queues-never-preempt", "ADM-5")] and dropped == 4
    assert [json.loads(x)["clause"] for x in (tmp_path / mutants.ROWS).read_text().splitlines()] == ["ADM-5"]
    superseded = list(tmp_path.glob("rows.superseded-*.jsonl"))
    assert len(superseded) == 1 and superseded[0].read_text().splitlines() == lines  # nothing lost


def test_the_suite_digest_moves_with_a_clause_but_not_with_the_catalogue(tmp_path):
    for part in ("conformance/x", "clusters/embedded/mutations"):
        (tmp_path / part).mkdir(parents=True)
    (tmp_path / "conformance/x/test_x.py").write_text("assert 1\n")
    (tmp_path / "clusters/embedded/mutations/catalogue.yaml").write_text("[]\n")
    before = mutants.suite_digest(tmp_path)
    (tmp_path / "clusters/embedded/mutations/catalogue.yaml").write_text("- id: new\n")
    assert mutants.suite_digest(tmp_path) == before
    (tmp_path / "conformance/x/test_x.py").write_text("assert 2\n")
    assert mutants.suite_digest(tmp_path) != before


def test_resuming_a_finished_run_starts_no_platform_and_prints_its_matrix(tmp_path, capsys, monkeypatch):
    never = mutations.entry("queues-never-preempt")
    (tmp_path / mutants.ROWS).write_text(json.dumps(_row(never, "ADM-5", mutants.suite_digest())) + "\n")

    def no_platform(*_args, **_kwargs):
        raise AssertionError("a finished row was run again")
    monkeypatch.setattr(mutants, "_platform", no_platform)
    assert mutants.main(["--id", "queues-never-preempt", "--resume", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "1 rows of this suite kept, 0 dropped" in out.err and "kill rate 1/1" in out.out
    assert (tmp_path / "matrix.txt").read_text().startswith("mutation")


def test_resume_needs_a_run_to_go_on_with(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mutants.main(["--id", "queues-never-preempt", "--resume", str(tmp_path / "none")])
    assert exc.value.code == 2 and "start a run with --out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        mutants.main(["--id", "queues-never-preempt", "--resume", str(tmp_path), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2


def test_an_entrys_change_is_put_on_once_for_its_rows_at_once_and_undone_after_the_last():
    entry = mutations.entry("tenants-share-one-cluster-queue")
    calls: list[str] = []

    def put_on():
        calls.append("put on")
        return {"teams": {"namespaceLabels": {"class": "x"}}}, lambda: calls.append("undone")

    in_force = mutants.InForce()
    with in_force.change(entry, put_on) as first:
        with in_force.change(entry, put_on) as second:
            assert first is second and calls == ["put on"]
        assert calls == ["put on"], "one row ended; the other still uses the change"
    assert calls == ["put on", "undone"]
    with in_force.change(entry, put_on):
        pass
    assert calls == ["put on", "undone", "put on", "undone"]
