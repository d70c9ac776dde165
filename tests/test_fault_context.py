"""``--context`` reaches every fault: the chaos functions and experiments act
on the kubeconfig context that was certified, not on the kubeconfig's
current context.

The static tests check every public fault function, every experiment and
every clause's ``runner.run`` call; the platform test builds a kubeconfig
whose current context points at a server that does not answer and whose
other context is the session's platform, and shows that the context is what
routes a fault.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import secrets
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from chaos import _kube, block_collectives, runner
from chaos.runner import EXPERIMENTS
from clusters import access

REPO = Path(__file__).resolve().parents[1]
FAULT_MODULES = ("chaos.block_collectives", "chaos.head_oom", "chaos.preempt_worker", "chaos.straggler", "chaos.rayjob")
DEAD_SERVER = "https://127.0.0.1:9"  # the discard port: nothing answers there
LIVE, DEAD = "rayproof-live", "rayproof-dead"


def _fault_functions() -> dict[str, Any]:
    """Every public function of the fault modules that takes a kubeconfig, by qualified name."""
    out = {}
    for name in FAULT_MODULES:
        module = importlib.import_module(name)
        out.update({f"{name}.{fname}": func for fname, func in inspect.getmembers(module, inspect.isfunction)
                    if func.__module__ == name and not fname.startswith("_")
                    and "kubeconfig" in inspect.signature(func).parameters})
    return out


@pytest.mark.parametrize("name", sorted(_fault_functions()))
def test_every_fault_function_taking_a_kubeconfig_takes_a_context(name: str) -> None:
    params = inspect.signature(_fault_functions()[name]).parameters
    assert "context" in params, f"{name} takes a kubeconfig but no context"
    assert params["context"].default == "", f"{name}: context must default to '' (the kubeconfig's current context)"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.json")), ids=lambda p: p.stem)
def test_every_experiment_passes_its_context_wherever_it_passes_the_kubeconfig(path: Path) -> None:
    exp = json.loads(path.read_text())
    assert exp["configuration"].get("context") == "", f"{path.name} does not declare context (default '')"
    activities = [*exp.get("steady-state-hypothesis", {}).get("probes", []), *exp["method"], *exp.get("rollbacks", [])]
    for act in activities:
        args = act["provider"].get("arguments", {})
        if "kubeconfig" in args:
            assert args.get("context") == "${context}", f"{path.name}:{act['name']} passes no ${{context}}"


def _runner_calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for path in sorted((REPO / "conformance").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "runner"):
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", node))
    return calls


def test_every_clause_runs_its_experiment_with_the_labs_context() -> None:
    calls = _runner_calls()
    assert len(calls) >= 7, f"expected the clauses' runner.run calls, found {[c for c, _ in calls]}"
    for where, call in calls:
        config = call.args[1]
        assert isinstance(config, ast.Dict), f"{where}: the configuration is not a literal dict"
        found = {k.value: ast.unparse(v) for k, v in zip(config.keys, config.values) if isinstance(k, ast.Constant)}
        assert found.get("context") == "lab.context", f"{where}: runner.run passes context={found.get('context')}"


# -- against the session's platform ------------------------------------------------------------


def _two_context_kubeconfig(target: Any, path: Path) -> Path:
    """A kubeconfig whose current context is a server that does not answer
    (with the platform's CA and credentials) and whose context LIVE is the
    platform's own (file paths in it made absolute)."""
    source = Path(target.kubeconfig)
    kc = yaml.safe_load(source.read_text())
    current = next(c for c in kc["contexts"] if c["name"] == kc["current-context"])["context"]
    cluster = next(c for c in kc["clusters"] if c["name"] == current["cluster"])["cluster"]
    user = next(u for u in kc["users"] if u["name"] == current["user"])["user"]
    paths = ((cluster, ("certificate-authority",)), (user, ("client-certificate", "client-key", "tokenFile")))
    for entry, keys in paths:
        for key in keys:
            if entry.get(key):
                entry[key] = str((source.parent / entry[key]).resolve())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": DEAD,
        "clusters": [{"name": LIVE, "cluster": cluster}, {"name": DEAD, "cluster": {**cluster, "server": DEAD_SERVER}}],
        "users": [{"name": "admin", "user": user}],
        "contexts": [{"name": LIVE, "context": {"cluster": LIVE, "user": "admin"}},
                     {"name": DEAD, "context": {"cluster": DEAD, "user": "admin"}}]}))
    return path


@pytest.fixture
def namespace(kube_api, run_id: str) -> Iterator[str]:
    """A namespace of its own on the session's platform (deleted at teardown)."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    ns = f"rp-fault-context-{secrets.token_hex(2)}"
    core.create_namespace({"metadata": {"name": ns, "labels": {"rayproof.io/run": run_id, "rayproof.io/test": ns}}})
    try:
        access.bind_run_role(kube_api, ns, {"rayproof.io/run": run_id})
        yield ns
    finally:
        core.delete_namespace(ns)


@pytest.mark.slow
def test_context_routes_a_fault_to_its_cluster_not_to_the_current_one(target, kube_api, namespace, tmp_path) -> None:
    from kubernetes import client

    kc = str(_two_context_kubeconfig(target, tmp_path / "kubeconfig"))
    assert _kube.api(kc, LIVE).configuration.host == kube_api.configuration.host
    assert _kube.api(kc).configuration.host == DEAD_SERVER

    # With the platform's context, the fault's whole round trip reaches the platform:
    # the policy it applies is there for the session's own client to see.
    def policies() -> set[str]:
        net = client.NetworkingV1Api(kube_api)
        return {p.metadata.name for p in net.list_namespaced_network_policy(namespace).items}

    assert block_collectives.steady_state(kc, namespace, context=LIVE)
    assert block_collectives.inject(kc, namespace, {"rayproof.io/test": namespace}, context=LIVE) \
        == block_collectives.DENY_NAME
    assert block_collectives.DENY_NAME in policies()
    assert not block_collectives.steady_state(kc, namespace, context=LIVE)
    assert block_collectives.revert(kc, namespace, context=LIVE) == [block_collectives.DENY_NAME]
    assert block_collectives.DENY_NAME not in policies()

    # Without it, the same call goes to the kubeconfig's current context: the dead server.
    with pytest.raises(Exception) as dead:  # noqa: PT011 - urllib3's connection error, whatever its class
        block_collectives.steady_state(kc, namespace)
    assert "port=9" in str(dead.value) or "127.0.0.1:9" in str(dead.value), dead.value

    # Through chaostoolkit: the experiment hands its context to every activity.
    # No such RayCluster: the hypothesis is not met, nothing is injected, the rollback lists pods.
    def rollback(context: str) -> dict[str, Any]:
        journal_path = tmp_path / f"journal-{context or 'current'}.json"
        try:
            runner.run("preempt-worker", {"kubeconfig": kc, "context": context, "namespace": namespace,
                                          "cluster": "no-such-cluster", "workers": 2, "within_s": 0},
                       journal_path=journal_path)
        except runner.RollbackFailed as exc:
            assert "127.0.0.1" in str(exc), exc
        journal = json.loads(journal_path.read_text())
        assert not journal["run"], f"the method ran: {journal['run']}"
        return journal["rollbacks"][0]

    live = rollback(LIVE)
    assert live["status"] == "succeeded" and live["output"] == "0 worker pods of no-such-cluster", live
    # The rollback against the dead server fails, and the run says so (RollbackFailed).
    dead_rollback = rollback("")
    assert dead_rollback["status"] == "failed" and "127.0.0.1" in json.dumps(dead_rollback, default=str), dead_rollback
