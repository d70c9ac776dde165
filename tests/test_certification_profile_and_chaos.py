"""The certification profile's validation, the straggler transform, the RayJob
wait's early stop, and the chaostoolkit experiments' consistency with the fault
modules (no cluster needed)."""
from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from chaos import rayjob, straggler
from chaos.runner import EXPERIMENTS
from core import kueue
from core import profile as profile_mod
from core.timeouts import Tier
from fixtures import golden
from fixtures import manifests as mf


def test_default_profile_is_valid() -> None:
    p = profile_mod.load()
    assert p.wait_for_pods_ready_s == 240
    assert p.ray_image == "rayproject/ray:2.60.0"
    assert p.worker_gpus == 8
    assert p["kueue"]["priorityClasses"] == {"low": "rayproof-low", "high": "rayproof-high"}


@pytest.mark.parametrize("override, message", [
    ({"kueue": {"preemtion": "Never"}}, "field kueue.preemtion: unknown"),
    ({"training": {"maxCollectiveTimeout": "soon"}}, "field training.maxCollectiveTimeout: must be a Go duration"),
    ({"workers": {"gpus": 8}}, "field workers: unknown; allowed here: templates"),
    ({"kueue": {"priorityClasses": {"high": "rayproof-low"}}}, "kueue.priorityClasses.high: must differ from low"),
    ({"serving": {"availabilityTarget": 1.5}}, "field serving.availabilityTarget"),
    ({"templates": {"rayJob": ""}}, "field templates.rayJob: must be a path to a YAML file"),
    ({"tenancy": {"rayClusters": "shared"}}, "field tenancy: unknown"),
    ({"teams": {"namespaceLabels": {"bad key!": "x"}}},
     "field teams.namespaceLabels: must be a mapping of Kubernetes label keys"),
    ({"teams": {"tenantLabel": "-x"}}, "field teams.tenantLabel: must be a Kubernetes label key"),
    ({"teams": {"localQueue": "Team_A"}}, "field teams.localQueue: must be a Kubernetes object name"),
])
def test_bad_profiles_name_the_field(override: dict, message: str) -> None:
    with pytest.raises(profile_mod.ProfileError, match=re.escape(message)):
        profile_mod.load(override)


def test_the_collective_block_restricts_worker_egress_whatever_ingress_the_platform_allows() -> None:
    """NetworkPolicies add up: the platform's worker policy admits the whole
    namespace, so the fault restricts the workers' egress (to the head and
    DNS), which no ingress rule can widen."""
    from chaos import block_collectives

    spec = block_collectives.deny_policy({})["spec"]
    assert spec["podSelector"] == block_collectives.WORKERS and spec["policyTypes"] == ["Egress"]
    assert spec["egress"][0] == {"to": [{"podSelector": {"matchLabels": {"ray.io/node-type": "head"}}}]}
    assert all("to" not in rule for rule in spec["egress"][1:]) and {p["port"] for p in spec["egress"][1]["ports"]} == {53}


def test_wait_for_pods_ready_can_be_declared_off(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("kueue:\n  waitForPodsReady: null\n")
    assert profile_mod.load(f).wait_for_pods_ready_s is None


def _job(workers: int = 2) -> dict:
    return golden.rayjob(profile_mod.load(), "j", {"rayproof.io/run": "r"}, "true", workers=workers, queue="team")


def test_straggler_moves_one_replica_into_a_delayed_group() -> None:
    job = straggler.with_straggler(_job(3), delay_s=40)
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert groups["workers"]["replicas"] == 2 and groups[straggler.STRAGGLER_GROUP]["replicas"] == 1
    init = groups[straggler.STRAGGLER_GROUP]["template"]["spec"]["initContainers"][0]
    assert "sleep 40.0" in init["command"][-1]
    assert mf.worker_count(job["spec"]["rayClusterSpec"]) == 3
    # the gang Kueue sees is unchanged: same pods, same resources
    assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "team"


def test_permanent_straggler_has_an_unpullable_image_and_original_is_untouched() -> None:
    original = _job(2)
    job = straggler.with_straggler(original, delay_s=None)
    late = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]
    assert late["template"]["spec"]["containers"][0]["image"] == straggler.UNPULLABLE_IMAGE
    assert original["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 2
    with pytest.raises(ValueError, match="at least 2 replicas"):
        straggler.with_straggler(_job(1), delay_s=10)


def test_a_straggler_with_the_platforms_slow_image_waits_on_a_real_pull_of_a_new_name() -> None:
    slow = profile_mod.load()["kueue"]["slowPullImage"]  # platform-owned-ok: the reference platform's, read
    jobs = [straggler.with_straggler(_job(2), delay_s=30, slow_image=slow) for _ in range(2)]
    inits = [j["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["template"]["spec"]["initContainers"][0] for j in jobs]
    assert all(i["image"].startswith("rayproof.local/slow-pull/30/busybox:") and "command" not in i for i in inits)
    assert all(i["name"] == straggler.SLOW_PULL_CONTAINER for i in inits)  # what ADM-3 finds its pull events by
    assert inits[0]["image"] != inits[1]["image"], "each straggler must pull a name no node holds yet"
    # the worker's own container is the template's, untouched
    assert jobs[0]["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["image"] == \
        _job(2)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"]


@pytest.mark.parametrize("value", ["rayproof.local/slow/busybox:{nonce}", "slow/{seconds}/busybox:latest",
                                   "bad image/{seconds}:{nonce}", 7])
def test_a_slow_pull_image_must_name_its_seconds_and_nonce(value: object) -> None:
    with pytest.raises(profile_mod.ProfileError, match=r"field kueue\.slowPullImage: must be an image reference with"):
        profile_mod.load({"kueue": {"slowPullImage": value}})
    assert profile_mod.load({"kueue": {"slowPullImage": None}})["kueue"]["slowPullImage"] is None


@pytest.mark.parametrize(("message", "seconds"), [
    ('Successfully pulled image "rayproject/ray:2.60.0" in 26.618s (26.618s including waiting). Image size: 1 bytes.',
     26.6),
    ('spec.containers{main}: Successfully pulled image "rayproject/ray:2.60.0" in 1m1.795s (1m1.795s including '
     'waiting). Image size: 6516194528 bytes.', 61.8),
    ('Successfully pulled image "redis:7.0" in 749ms (749ms including waiting). Image size: 138077005 bytes.', 0.7),
    ('Successfully pulled image "rayproof.local/slow-pull/30/busybox:1f2e" in 30.012s', 30.0),  # the slow path's
    ('Container image "rayproject/ray:2.60.0" already present on machine', None),
])
def test_a_pull_time_is_read_from_kubelets_event(message: str, seconds: float | None) -> None:
    assert straggler.pull_seconds(message) == seconds


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.json")), ids=lambda p: p.stem)
def test_experiment_calls_existing_functions_with_declared_variables(path: Path) -> None:
    """Every activity names a real function of a chaos module, passes only
    arguments it accepts (and every one it requires), and every ${var} it uses
    is declared in the experiment's configuration."""
    exp = json.loads(path.read_text())
    declared = set(exp["configuration"])
    activities = [*exp.get("steady-state-hypothesis", {}).get("probes", []), *exp["method"], *exp.get("rollbacks", [])]
    assert exp["method"], f"{path.name} has an empty method"
    for act in activities:
        prov = act["provider"]
        func = getattr(importlib.import_module(prov["module"]), prov["func"])
        params = inspect.signature(func).parameters
        args = prov.get("arguments", {})
        assert set(args) <= set(params), f"{path.name}:{act['name']}: {set(args) - set(params)} not accepted by {func}"
        required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
        assert required <= set(args), f"{path.name}:{act['name']}: {required - set(args)} missing"
        for value in args.values():
            for var in re.findall(r"\$\{(\w+)\}", json.dumps(value)):
                assert var in declared, f"{path.name}:{act['name']} uses undeclared ${{{var}}}"


class _FakeCustomApi:
    """Just enough of CustomObjectsApi for chaos.rayjob: one suspended RayJob and the given Workloads."""

    def __init__(self, labels: dict[str, str], workloads: list[dict]):
        self.job = {"metadata": {"name": "j", "labels": labels}, "status": {"jobDeploymentStatus": "Suspended"}}
        self.items = workloads

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return self.job

    def list_namespaced_custom_object(self, group, version, namespace, plural):
        return {"items": self.items}


@pytest.mark.parametrize("labels, workloads, early", [
    ({kueue.QUEUE_LABEL: "q"}, [], True),  # queued, no Workload: Kueue does not manage RayJobs
    ({kueue.QUEUE_LABEL: "q"}, [{"metadata": {"ownerReferences": [{"kind": "RayJob", "name": "j"}]}}], False),
    ({}, [], False),  # not queued: nothing to expect of Kueue
])
def test_waiting_on_a_queued_rayjob_without_a_workload_ends_early_naming_the_cause(monkeypatch, labels, workloads,
                                                                                 early) -> None:
    monkeypatch.setattr(rayjob, "CONTROLLER_RECONCILE", Tier("controller_reconcile", 0, "test"))
    monkeypatch.setattr(rayjob._kube, "custom", lambda kubeconfig, context="": _FakeCustomApi(labels, workloads))
    out = rayjob.wait_state("", "ns", "j", "finished", within_s=3)
    assert not out["reached"]
    if early:
        assert out["elapsed_s"] < 2 and "Kueue does not manage RayJobs" in out["cause"]
    else:
        assert out["elapsed_s"] >= 3 and out["cause"] is None


def test_lab_teardown_deletes_its_namespaces_even_when_deleting_ray_objects_fails() -> None:
    """The namespaces of a test go at teardown whatever happens before: here the
    API refuses to delete Ray objects, and both namespaces are still deleted."""
    import contextlib
    import types

    from kubernetes.client import ApiException

    from fixtures.kube import Lab

    deleted = []
    lab = Lab.__new__(Lab)
    lab.namespaces, lab.key = ["rp-x-a", "rp-x-b"], "x"

    def refuse(*args, **kwargs):
        raise ApiException(status=500, reason="etcd is unhappy")

    lab.custom = types.SimpleNamespace(delete_collection_namespaced_custom_object=refuse)
    lab.core = types.SimpleNamespace(
        delete_namespace=lambda name, **kw: deleted.append(name),
        list_namespace=lambda **kw: types.SimpleNamespace(items=[]))
    with pytest.raises(ApiException), contextlib.ExitStack() as stack:
        stack.callback(lab._delete_namespaces)
    assert deleted == ["rp-x-a", "rp-x-b"]


def test_the_evidence_says_whether_the_suite_or_the_platform_made_the_gcs_redis_secret() -> None:
    """The Secret a golden template's redisPassword names: the suite makes it
    with a random password where the team namespace lacks it; one the
    platform's onboarding made (409) is left as it was; the evidence says which."""
    import types

    from kubernetes.client import ApiException

    from fixtures.kube import Lab
    from fixtures.plugin import Evidence

    made = []

    def create(namespace, body):
        if namespace == "rp-x-b":
            raise ApiException(status=409, reason="AlreadyExists")
        made.append((namespace, body["metadata"]["name"], sorted(body["stringData"])))

    lab = Lab.__new__(Lab)
    lab.labels, lab.evidence = {"rayproof.io/run": "r"}, Evidence()
    lab.core = types.SimpleNamespace(create_namespaced_secret=create)
    lab._create_redis_secret("rp-x-a", "gcs-redis", "password")
    lab._create_redis_secret("rp-x-b", "gcs-redis", "password")
    assert made == [("rp-x-a", "gcs-redis", ["password"])]
    assert lab.evidence.values["gcs_redis_secrets"] == {
        "rp-x-a/gcs-redis": "the suite (a new random password)",
        "rp-x-b/gcs-redis": "the platform (present before the suite; left as it was, never read)"}


def test_oom_probe_requires_a_new_termination_not_an_earlier_oom_kill(monkeypatch) -> None:
    """A head whose last termination is an OOMKilled from before the fault
    (restart count unchanged) is not this fault's OOM kill; one more restart
    ending OOMKilled is. Without a count given, the probe reads the count
    inject recorded on the pressure job."""
    from chaos import head_oom

    states = iter([{"restarts": 2, "last_reason": "OOMKilled"}] * 3 + [{"restarts": 3, "last_reason": "OOMKilled"}] * 9)
    monkeypatch.setattr(head_oom, "head_restarts", lambda *a, **kw: {"restarts": 2, "last_reason": "OOMKilled"})
    stale = head_oom.wait_oom_killed("", "ns", "c", within_s=2, restarts_before=2)
    assert not stale["reached"] and stale["restarts_before"] == 2
    monkeypatch.setattr(head_oom, "head_restarts", lambda *a, **kw: next(states))
    assert head_oom.wait_oom_killed("", "ns", "c", within_s=10, restarts_before=2)["reached"]

    job = head_oom.pressure_job("p", "c", 1, restarts_before=2)
    assert job["metadata"]["annotations"] == {head_oom.RESTARTS_BEFORE_ANNOTATION: "2"}
    fake = type("Custom", (), {"get_namespaced_custom_object": lambda self, *a: job})()
    monkeypatch.setattr(head_oom._kube, "custom", lambda kubeconfig, context="": fake)
    monkeypatch.setattr(head_oom, "head_restarts", lambda *a, **kw: {"restarts": 2, "last_reason": "OOMKilled"})
    recorded = head_oom.wait_oom_killed("", "ns", "c", within_s=1, pressure_job="p")
    assert not recorded["reached"] and recorded["restarts_before"] == 2


def test_gcs1_counts_the_cluster_back_only_when_the_gcs_lists_a_new_head_and_every_worker() -> None:
    from conformance.gcs.test_gcs import nodes_back, series_summary

    before = {"ts": 0, "alive": 2, "alive_nodes": ["head:old", "worker:w1"]}
    series = [{"ts": 1, "alive": 2, "alive_nodes": ["head:old", "worker:w1"]},  # before the fault
              {"ts": 2, "error": "URLError: connection refused"},  # the head is down
              {"ts": 3, "alive": 3, "alive_nodes": ["head:new", "head:old", "worker:w1"]},  # the dead head still listed
              {"ts": 4, "alive": 1, "alive_nodes": ["head:new"]},  # the worker not (yet) back
              {"ts": 5, "alive": 2, "alive_nodes": ["head:new", "worker:w1"]}]
    assert nodes_back(series, before, after=0)["ts"] == 5
    assert nodes_back(series[:4], before, after=0) is None
    runs = series_summary(series, since=1)
    assert [(r["value"], r["from_s"], r["samples"]) for r in runs] == [
        ("alive=2", 0, 1), ("no answer", 1, 1), ("alive=3", 2, 1), ("alive=1", 3, 1), ("alive=2", 4, 1)]


def test_gcs1_names_each_worker_pod_restarted_or_replaced_and_how_it_ended() -> None:
    from conformance.gcs.test_gcs import worker_changes

    def pod(uid: str, restarts: int, ended: list[str] = ()) -> dict:
        return {"uid": uid, "restarts": restarts, "deleting": False, "last_terminations": list(ended)}

    before = {"w-a": pod("1", 0), "w-b": pod("2", 0)}
    assert worker_changes(before, dict(before)) == []
    changed = worker_changes(before, {"w-a": pod("1", 1, ["ray-worker: Error (exit 1) at t"]), "w-c": pod("3", 0)})
    assert any("w-a restarted (0 -> 1" in c and "Error (exit 1)" in c for c in changed), changed
    assert any("w-b is gone (replaced by ['w-c'])" in c for c in changed), changed
    assert any("w-c is new" in c for c in changed), changed


def test_a_failed_rollback_fails_the_run_though_chaoslib_calls_it_completed(tmp_path: Path, monkeypatch) -> None:
    """A fault whose rollback fails (a 403 on deleting its policy, say) may
    still be in place: the run raises, naming the rollback and its error."""
    from chaos import runner

    experiment = {
        "title": "a rollback that fails", "description": "a method that works, then a rollback that raises",
        "configuration": {},
        "method": [{"type": "action", "name": "inject", "provider": {
            "type": "python", "module": "os.path", "func": "exists", "arguments": {"path": "/"}}}],
        "rollbacks": [{"type": "action", "name": "remove-the-fault", "provider": {
            "type": "python", "module": "os", "func": "stat", "arguments": {"path": str(tmp_path / "gone")}}}],
    }
    (tmp_path / "rollback-fails.json").write_text(json.dumps(experiment))
    monkeypatch.setattr(runner, "EXPERIMENTS", tmp_path)
    with pytest.raises(runner.RollbackFailed, match=r"rollback 'remove-the-fault' failed: .*gone"):
        runner.run("rollback-fails", {}, journal_path=tmp_path / "journal.json")
    journal = json.loads((tmp_path / "journal.json").read_text())
    assert journal["status"] == "completed", "chaoslib itself does not fail such a run"
