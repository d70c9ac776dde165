from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayproof import cli

CLAUSE_OK = '''
import pytest

@pytest.mark.clause("T-1")
def test_ok(evidence):
    """The thing MUST work."""
    evidence.record("figure", 3)

@pytest.mark.clause("T-2")
def test_na():
    """The other thing MUST hold where it applies."""
    pytest.skip("not applicable: the cluster has no policy engine")
'''


def _suite(pytester, body: str):
    pytester.makeconftest('pytest_plugins = ["fixtures.plugin"]')
    pytester.mkdir("conformance")
    pytester.path.joinpath("conformance", "test_x.py").write_text(body)


def test_results_carry_clause_must_evidence_and_not_applicable(pytester):
    _suite(pytester, CLAUSE_OK)
    out = pytester.path / "results.json"
    result = pytester.runpytest("conformance", f"--rayproof-results={out}")
    result.assert_outcomes(passed=1, skipped=1)
    rows = {r["clause"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["T-1"]["outcome"] == "passed" and rows["T-1"]["evidence"] == {"figure": 3}
    assert rows["T-1"]["must"] == "The thing MUST work."
    assert rows["T-2"]["outcome"] == "not_applicable"


def test_a_run_the_cli_opened_names_the_cluster_as_the_cli_described_it(pytester):
    _suite(pytester, CLAUSE_OK)
    out, opened = pytester.path / "results.json", pytester.path / "opened-cluster.json"
    opened.write_text(json.dumps({"target": {"kind": "existing", "server": "https://example.invalid"},
                                  "preflight": "passed"}))
    pytester.runpytest("conformance", f"--rayproof-results={out}", f"--rayproof-opened={opened}").assert_outcomes(
        passed=1, skipped=1)
    assert json.loads(out.read_text())["target"] == {"kind": "existing", "server": "https://example.invalid"}
    opened.write_text("[]")
    result = pytester.runpytest("conformance", f"--rayproof-opened={opened}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "not a record of an opened cluster" in result.stderr.str()


CLAUSE_ON_A_BUSY_MACHINE = '''
import pytest

from fixtures.sharing import SharesNotFree

@pytest.fixture
def shares():
    raise SharesNotFree("could not start, so it was not judged: timed out waiting for 1 of the 2 shares")

@pytest.mark.clause("T-1")
def test_busy(shares):
    """The thing MUST work."""

@pytest.mark.clause("T-2")
def test_broken():
    """The other thing MUST work."""
    raise RuntimeError("the platform broke it")
'''


def test_a_clause_that_waited_out_its_shares_is_marked_not_run(pytester):
    _suite(pytester, CLAUSE_ON_A_BUSY_MACHINE)
    out = pytester.path / "results.json"
    pytester.runpytest("conformance", f"--rayproof-results={out}").assert_outcomes(errors=1, failed=1)
    rows = {r["clause"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["T-1"]["outcome"] == "error" and rows["T-1"]["not_run"] is True
    assert rows["T-2"]["not_run"] is False


CLAUSE_ACROSS_A_CLOCK_STEP = '''
import time

import pytest

@pytest.mark.clause("T-1")
def test_timed(evidence, monkeypatch):
    """The thing MUST happen in time."""
    stepped = time.time() + 57  # the wall clock steps forward mid-clause (NTP, a paused VM)
    monkeypatch.setattr(time, "time", lambda: stepped)
    assert False, "late"
'''


def test_a_step_of_the_wall_clock_during_a_clause_is_in_its_evidence(pytester):
    _suite(pytester, CLAUSE_ACROSS_A_CLOCK_STEP)
    out = pytester.path / "results.json"
    result = pytester.runpytest("conformance", f"--rayproof-results={out}")
    result.assert_outcomes(failed=1)
    row = json.loads(out.read_text())["results"][0]
    assert 56 <= row["evidence"]["wall_clock_step_s"] <= 58
    result.stdout.fnmatch_lines(["*evidence: clock*", "*wall clock moved +5* s against its monotonic clock*"])


def test_clauses_are_selected_by_their_id(pytester):
    _suite(pytester, CLAUSE_OK)
    pytester.runpytest("conformance", "-k", "T-1").assert_outcomes(passed=1)
    pytester.runpytest("conformance", "-k", "T-").assert_outcomes(passed=1, skipped=1)


def test_conformance_test_without_clause_or_must_is_refused(pytester):
    _suite(pytester, 'import pytest\n\ndef test_bare():\n    pass\n\n'
                     '@pytest.mark.clause("T-3")\ndef test_no_must():\n    """Says nothing binding."""\n')
    result = pytester.runpytest("conformance")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*conformance test without @pytest.mark.clause(ID)*",
                                 "*clause T-3 has no MUST in its docstring*"])


def test_report_command_rebuilds_summary_without_a_cluster(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"started": 1, "finished": 2, "host": "h", "exit_status": 0, "catalogue": ["T-1"],
                                   "results": [{"nodeid": "n", "clause": "T-1", "must": "MUST", "outcome": "passed",
                                                "phase": "call", "duration_s": 1, "evidence": {}, "message": ""}]}))
    assert cli.main(["report", str(results)]) == 0
    assert json.loads((tmp_path / "certification.json").read_text())["verdict"] == "CERTIFIED"


def test_the_catalogue_is_every_clause_pytest_collects_from_conformance(pytester):
    from core.catalogue import CONFORMANCE, catalogue

    pytester.makeconftest('pytest_plugins = ["fixtures.plugin"]')
    result = pytester.runpytest(str(CONFORMANCE), "--collect-only", "-q", "-p", "no:cacheprovider")
    collected = {line.split("::")[-1] for line in result.outlines if "::test_" in line}
    assert len(collected) == len(catalogue()) == 17, (collected, catalogue())
    assert not [cid for cid in catalogue() if cid.startswith("WL-")], "the runtime tier is not certified"


def test_results_record_the_catalogue_and_changed_bounds(pytester, monkeypatch):
    from core.catalogue import catalogue

    monkeypatch.setenv("RAYPROOF_TIMEOUT_TRAINING_RUN", "900")
    _suite(pytester, CLAUSE_OK)
    out = pytester.path / "results.json"
    pytester.runpytest("conformance", f"--rayproof-results={out}").assert_outcomes(passed=1, skipped=1)
    payload = json.loads(out.read_text())
    assert payload["catalogue"] == catalogue()
    assert payload["timeout_overrides"] == {"RAYPROOF_TIMEOUT_TRAINING_RUN": "900"}
    assert payload["profile_outside_ranges"] == [], "the default profile's promises are in range"


def test_certify_help_documents_its_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        cli.main(["certify", "--help"])
    out = capsys.readouterr().out
    for status, word in ((0, "CERTIFIED"), (1, "NOT CERTIFIED"), (3, "PARTIAL"), (4, "preflight"), (5, "internal")):
        assert f"  {status}  " in out and word in out, out


def test_report_command_on_missing_file_says_what_to_pass(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope.json")]) == 2
    assert "pass the results.json of a certification run" in capsys.readouterr().err


def test_certify_with_a_bad_profile_says_which_field_and_creates_nothing(tmp_path, capsys):
    bad = tmp_path / "profile.yaml"
    bad.write_text("training:\n  maxCollectiveTimeout: soon\n")
    out = tmp_path / "out"
    assert cli.main(["certify", "--profile", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bad profile" in err and "field training.maxCollectiveTimeout" in err, err
    assert not out.exists()


def test_certify_against_a_missing_kubeconfig_says_what_to_pass(tmp_path, capsys):
    assert cli.main(["certify", "--kubeconfig", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist; pass the path of a kubeconfig file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_certify_against_an_unreachable_api_server_stops_at_preflight(tmp_path, capsys):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    out = tmp_path / "out"
    assert cli.main(["certify", "--kubeconfig", str(kubeconfig), "--out", str(out)]) == cli.PREFLIGHT_EXIT
    err = capsys.readouterr().err
    assert "cannot reach the API server at https://127.0.0.1:1" in err and "nothing was created" in err, err
    assert not out.exists()


def test_certify_with_a_bad_kubeconfig_or_context_is_bad_input(tmp_path, capsys):
    garbage = tmp_path / "garbage"
    garbage.write_text("::: not yaml [")
    assert cli.main(["certify", "--kubeconfig", str(garbage), "--out", str(tmp_path / "out")]) == cli.BAD_INPUT_EXIT
    assert "cannot be read as a kubeconfig" in capsys.readouterr().err
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    assert cli.main(["certify", "--kubeconfig", str(kubeconfig), "--context", "other",
                     "--out", str(tmp_path / "out")]) == cli.BAD_INPUT_EXIT
    assert "has no context 'other'; it has c" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_test_command_hands_pytest_options_to_pytest(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_pytest", lambda args: seen.append(args) or 0)
    assert cli.main(["test", "-k", "ADM", "-x"]) == 0
    assert seen[0][-3:] == ["-k", "ADM", "-x"] and seen[0][:4] == cli.WORKERS, seen
    assert "--durations=40" in seen[0], "the run says where its time went"
    assert cli.main(["test", "--durations=5", "-n", "0"]) == 0
    assert "--durations=5" in seen[1] and "--durations=40" not in seen[1], seen[1]
    with pytest.raises(SystemExit):
        cli.main(["report", "results.json", "-k", "ADM"])


REFUSED_IN_EVERY_WORKER = '''
import pytest

from fixtures.kube import exit_run

@pytest.fixture(scope="session")
def platform(request):
    exit_run(request, "rayproof: the platform was started from other files; run `bin/rayproof down`", 4)

@pytest.mark.clause("T-1")
def test_one(platform):
    """The thing MUST work."""

@pytest.mark.clause("T-2")
def test_two(platform):
    """The other thing MUST work."""
'''


def test_a_run_ended_by_xdist_workers_keeps_their_message_and_exit_code(pytester, monkeypatch):
    """A worker that refuses the platform ends the run with its reason and code; xdist alone
    would call it a crash (INTERNALERROR, exit 3) and drop the message."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # this checkout, for the workers
    _suite(pytester, REFUSED_IN_EVERY_WORKER)
    out = pytester.path / "results.json"
    result = pytester.runpytest_subprocess("conformance", "-n", "2", "-p", "no:cacheprovider",
                                           f"--rayproof-results={out}")
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == 4, text
    assert "INTERNALERROR" not in text, text
    assert "the platform was started from other files" in text, text
    assert json.loads(out.read_text())["exit_status"] == 4


def test_every_platform_a_self_test_starts_takes_the_runs_platform_profile_as_its_base(tmp_path, monkeypatch):
    """`bin/rayproof test --platform-profile two-nodes.yaml` gives the self-tests' misconfigured
    platforms two nodes too: each one's own change over the run's profile."""
    import contextlib

    import yaml

    from tests.selftest import clause_runs

    run_profile = tmp_path / "two-nodes.yaml"
    run_profile.write_text("nodes:\n  runtime: kubelet\n  count: 2\n")
    config = type("Config", (), {"getoption": staticmethod(
        lambda name: str(run_profile) if name == "--platform-profile" else None)})()
    started = []

    class Target:
        @classmethod
        def start(cls, *, name, profile, progress, wait_for_room):
            assert wait_for_room, "a self-test's platform waits for the run's others to leave it room"
            started.append((name, yaml.safe_load(Path(profile).read_text())))
            return cls()

        def close(self):
            started.append("closed")

        @staticmethod
        def wait_for_room(*, name, profile):
            started.append(f"room for {name}")

    monkeypatch.setattr(clause_runs, "EmbeddedTarget", Target)
    monkeypatch.setattr(clause_runs, "host_slot", contextlib.nullcontext)
    factory = type("Factory", (), {"mktemp": staticmethod(lambda name: tmp_path / name)})()
    (tmp_path / "selftest-broken").mkdir()
    platform = clause_runs.misconfigured_platform(
        config, factory, "selftest-broken", {"nodes": {"count": 3}, "network": {"enforceNetworkPolicy": False}})
    assert next(platform)[0] == "selftest-broken"
    platform.close()
    assert started == ["room for selftest-broken",
                       ("selftest-broken", {"nodes": {"runtime": "kubelet", "count": 3},
                                            "network": {"enforceNetworkPolicy": False}}), "closed"]


def test_a_self_test_module_holds_one_of_its_platforms_at_a_time(tmp_path, monkeypatch):
    """Asking for another platform takes the last one down first; asking for the same one again reuses it."""
    from tests.selftest import clause_runs

    events = []

    def platform(config, factory, name, profile):
        events.append(f"up {name}")
        try:
            yield name, tmp_path / name
        finally:
            events.append(f"down {name}")

    monkeypatch.setattr(clause_runs, "misconfigured_platform", platform)
    one = clause_runs.OnePlatformAtATime(config=None, tmp_path_factory=None)
    assert one.get("impatient", {})[0] == "impatient"
    assert one.get("impatient", {})[0] == "impatient"
    assert one.get("broken", {})[0] == "broken"
    assert events == ["up impatient", "down impatient", "up broken"]
    one.close()
    one.close()
    assert events[-1] == "down broken" and len(events) == 4


def test_a_bad_platform_profile_stops_the_run_before_it_starts_and_names_the_users_file(pytester, tmp_path,
                                                                                       monkeypatch):
    """The self-tests merge ``--platform-profile`` into temporary copies of their own; a bad field in it
    is reported once, at the start, against the file the user named (pytest's usage error, exit 4)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # this checkout, for pytest's process
    bad = tmp_path / "real-nodes.yaml"
    bad.write_text("nodes:\n  runtime: kubelets\n")
    pytester.makeconftest('pytest_plugins = ["fixtures.plugin"]')
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--platform-profile={bad}")
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == 4, text
    assert f"--platform-profile: {bad}: field nodes.runtime: must be one of kubelet; got 'kubelets'" in text
    assert "passed" not in text, "no test ran"
    bad.write_text("nodes:\n  runtime: kubelet\n")
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--platform-profile={bad}").ret == 0


@pytest.mark.parametrize("make, words", [
    (lambda p: (p.write_text("x"), p)[1], "is a file, not a directory"),
    (lambda p: (p.mkdir(), (p / "key.pem").write_text("secret"), p)[2], "is not empty"),
    (lambda p: p / ("x" * 300), "longer than this system allows"),
])
def test_certify_refuses_an_unusable_out_before_anything_else(tmp_path, capsys, make, words):
    """One line, exit 2, nothing created, before the profile, the kubeconfig or the cluster are looked at."""
    out = make(tmp_path / "out")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert cli.main(["certify", "--kubeconfig", str(tmp_path / "nope"), "--out", str(out)]) == cli.BAD_INPUT_EXIT
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_certify_refuses_a_k_that_selects_no_clause_before_touching_a_cluster(tmp_path, capsys, monkeypatch):
    opened = []
    monkeypatch.setattr(cli, "_open_certified_cluster", lambda *a: opened.append(a) or cli.PREFLIGHT_EXIT)
    assert cli.main(["certify", "-k", "NO-SUCH-CLAUSE", "--out", str(tmp_path / "out")]) == cli.BAD_INPUT_EXIT
    assert "selects no clause" in capsys.readouterr().err
    assert not opened and not (tmp_path / "out").exists()
    assert cli.clauses_selected("NET-2") == ["conformance/network/test_network.py::"
                                            "test_platform_worker_policy_lets_training_run"]


def test_report_on_an_empty_or_non_json_file_is_bad_input(tmp_path, capsys):
    for name, text in (("empty.json", ""), ("text.json", "not json"), ("list.json", "[1, 2]")):
        (tmp_path / name).write_text(text)
        assert cli.main(["report", str(tmp_path / name)]) == cli.BAD_INPUT_EXIT
        err = capsys.readouterr().err
        assert "is not the results.json of a certification run" in err and "Traceback" not in err, err


def test_relative_paths_are_the_callers(tmp_path, monkeypatch, capsys):
    """bin/rayproof changes into the repository; a relative --kubeconfig is
    still read from where the user ran it."""
    monkeypatch.setenv(cli.CALLER_CWD_ENV, str(tmp_path))
    (tmp_path / "kc.yaml").write_text("::: not yaml [")
    assert cli.main(["certify", "--kubeconfig", "kc.yaml", "--out", "out"]) == cli.BAD_INPUT_EXIT
    err = capsys.readouterr().err
    assert str(tmp_path / "kc.yaml") in err and "cannot be read as a kubeconfig" in err, err
    assert not (tmp_path / "out").exists()


def test_platform_commands_with_a_bad_name_or_profile_are_bad_input(tmp_path, capsys):
    assert cli.main(["status", "--name", "Bad_Name!"]) == cli.BAD_INPUT_EXIT
    assert "platform name 'Bad_Name!' must be" in capsys.readouterr().err
    assert cli.main(["down", "--name", "ok", "--profile", str(tmp_path / "none.yaml")]) == cli.BAD_INPUT_EXIT
    assert "cannot read profile" in capsys.readouterr().err


def test_clean_looks_at_every_embedded_platform_and_names_those_it_could_not_check(monkeypatch, capsys):
    """Without --kubeconfig or --platform-name, `clean` sweeps every running
    embedded platform of the machine (as its certifier) and says which it
    could not check, instead of looking at `default` alone."""
    from fixtures import janitor

    seen = []
    monkeypatch.setattr(janitor, "sweep", lambda **kw: [])
    monkeypatch.setattr(janitor, "embedded_clusters_to_clean",
                        lambda: ([("a", "api-a"), ("b", "api-b")], ["embedded platform c (failed, not healthy)"]))
    monkeypatch.setattr(janitor, "orphaned_on_cluster", lambda api, **kw: seen.append(api) or [f"left-on-{api}"])
    monkeypatch.setattr(janitor, "clean_on_cluster", lambda api, left: [f"namespace of {left[0]}"] if api == "api-b" else [])
    assert cli.main(["clean"]) == 0
    out, err = capsys.readouterr()
    assert seen == ["api-a", "api-b"]
    assert "deleted namespace of left-on-api-b (platform b)" in out
    assert "could not check embedded platform c (failed, not healthy)" in err


def test_the_test_command_runs_one_tier_of_the_clause_passes_and_self_tests_unless_all(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "_pytest", lambda args: seen.append(args) or 0)
    assert cli.main(["test", "-x"]) == 0
    tier = seen[0][seen[0].index("--tier") + 1]
    assert tier in ("0/3", "1/3", "2/3") and "bin/rayproof test --all" in capsys.readouterr().out
    assert cli.main(["test", "--all", "-x"]) == 0
    assert "--tier" not in seen[1] and "--all" not in seen[1] and seen[1][-1] == "-x"


def test_the_tier_that_ran_is_a_property_of_the_junit_report(pytester):
    _suite(pytester, CLAUSE_OK)
    pytester.runpytest("conformance", "--tier", "1/3", "--junitxml=junit.xml")  # one of the two clauses
    report = (pytester.path / "junit.xml").read_text()
    assert '<property name="rayproof_tier" value="1/3 of the clause passes and self-tests (TIERS=3)"' in report, report
    pytester.runpytest("conformance", "--junitxml=all.xml")
    assert "rayproof_tier" not in (pytester.path / "all.xml").read_text()


def test_tiers_deal_out_whole_units_and_together_run_everything():
    """Each clause pass and each self-test chain (its xdist group) goes to exactly one tier; every other test to all."""
    from types import SimpleNamespace as NS

    from fixtures.plugin import tier_of

    def item(nodeid: str, slow: bool = True, group: str | None = None) -> NS:
        marks = {"slow": NS(args=()) if slow else None, "xdist_group": NS(args=(group,), kwargs={}) if group else None}
        return NS(nodeid=nodeid, get_closest_marker=lambda name: marks.get(name))

    items = [item("conformance/a.py::test_adm1"), item("conformance/a.py::test_adm2"),
             item("tests/selftest/s.py::test_x", group="lane"), item("tests/selftest/s.py::test_y", group="lane"),
             item("tests/test_unit.py::test_fast", slow=False), item("tests/embedded/e.py::test_platform")]
    tiers = [tier_of(items, f"{k}/2") for k in (0, 1)]
    always = {"tests/test_unit.py::test_fast", "tests/embedded/e.py::test_platform"}
    ran = [{i.nodeid for i in keep} for keep, _ in tiers]
    assert always <= ran[0] and always <= ran[1]
    assert (ran[0] | ran[1]) == {i.nodeid for i in items} and (ran[0] & ran[1]) == always
    lane = {"tests/selftest/s.py::test_x", "tests/selftest/s.py::test_y"}
    assert lane <= ran[0] or lane <= ran[1], "a self-test chain stays whole"
    with pytest.raises(pytest.UsageError, match="give K/N"):
        tier_of(items, "2/2")


def test_the_runtime_tiers_clauses_and_end_to_end_certifications_rotate_as_whole_groups():
    from types import SimpleNamespace as NS

    from fixtures.plugin import rotating_unit

    def item(nodeid: str, group: str | None = None, slow: bool = False) -> NS:
        marks = {"slow": NS(args=()) if slow else None, "xdist_group": NS(args=(group,), kwargs={}) if group else None}
        return NS(nodeid=nodeid, get_closest_marker=lambda name: marks.get(name))

    assert rotating_unit(item("tests/runtime/test_training.py::test_resume", group="local-ray")) == "local-ray"
    assert rotating_unit(item("tests/test_certify_verdict.py::test_subset", group="certify-sweeps", slow=True)) \
        == "certify-sweeps"
    assert rotating_unit(item("conformance/a.py::test_adm1", slow=True)) == "conformance/a.py::test_adm1"
    # Every tier: local Ray's own infrastructure tests in the runtime tier's group, the platform tests, unit tests.
    assert rotating_unit(item("tests/test_local_infra.py::test_node_restarts", group="local-ray")) is None
    assert rotating_unit(item("tests/embedded/test_real_nodes.py::test_oom", group="real-nodes", slow=True)) is None
    assert rotating_unit(item("tests/selftest/test_x.py::test_unit_of_a_helper")) is None


def test_tiers_weigh_a_unit_by_its_tests_and_the_platforms_it_starts():
    """A self-test chain of two tests on a platform of its own weighs as much as four clause passes."""
    from types import SimpleNamespace as NS

    from fixtures.plugin import PLATFORM_START_WEIGHT, tier_of

    def item(nodeid: str, group: str | None = None, fixtures: tuple[str, ...] = ()) -> NS:
        marks = {"slow": NS(args=()), "xdist_group": NS(args=(group,), kwargs={}) if group else None}
        return NS(nodeid=nodeid, get_closest_marker=lambda name: marks.get(name), fixturenames=fixtures)

    assert PLATFORM_START_WEIGHT == 2
    chain = [item(f"tests/selftest/s.py::test_{x}", group="lane", fixtures=("broken_platform", "tmp_path"))
             for x in "xy"]
    passes = [item(f"conformance/a.py::test_{x}") for x in "abcd"]
    dealt = [{i.nodeid for i in tier_of([*passes, *chain], f"{k}/2")[0]} for k in (0, 1)]
    assert dealt == [{i.nodeid for i in chain}, {i.nodeid for i in passes}]
