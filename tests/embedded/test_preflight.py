"""Preflight: each way a cluster cannot be certified gives one message saying
what to do, and nothing is created (against the embedded platform)."""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client, config

from clusters import preflight as pf
from rayproof import profile as profile_mod, timeouts
from rayproof.waiting import wait_for

pytestmark = pytest.mark.slow


def _namespaces(api: Any) -> set[str]:
    return {n.metadata.name for n in client.CoreV1Api(api).list_namespace().items}


def _kubeconfig_with(target: Any, tmp_path: Path, *, server: str | None = None, token: str | None = None) -> Path:
    kc = yaml.safe_load(Path(target.kubeconfig).read_text())
    if server:
        kc["clusters"][0]["cluster"]["server"] = server
    if token:
        kc["users"][0]["user"] = {"token": token}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kc))
    return path


def test_unreachable_api_server_is_one_clear_message(target, tmp_path) -> None:
    kc = _kubeconfig_with(target, tmp_path, server="https://127.0.0.1:1")
    api = config.new_client_from_config(config_file=str(kc))
    with pytest.raises(pf.PreflightError, match=r"cannot reach the API server at https://127.0.0.1:1: .*Check the kubeconfig"):
        pf.preflight(api, profile_mod.load(), server_timeout_s=3)


def test_missing_api_names_what_to_install_and_creates_nothing(kube_api, monkeypatch) -> None:
    before = _namespaces(kube_api)
    monkeypatch.setattr(pf, "REQUIRED_APIS", (*pf.REQUIRED_APIS,
                                              ("ray.io", "v1", "rayfoos", "a KubeRay with RayFoos"),
                                              ("kueue.x-k8s.io", "v9", "clusterqueues", "Kueue v9")))
    with pytest.raises(pf.PreflightError) as exc:
        pf.preflight(kube_api, profile_mod.load())
    text = str(exc.value)
    assert "ray.io/v1 rayfoos (install a KubeRay with RayFoos)" in text and "kueue.x-k8s.io/v9 clusterqueues" in text, text
    assert "rayclusters" not in text, f"served APIs reported missing: {text}"
    assert _namespaces(kube_api) == before


@pytest.fixture
def unprivileged_token(kube_api, run_id: str) -> Iterator[str]:
    """A service account with no role bindings in a namespace of its own (deleted at teardown)."""
    core = client.CoreV1Api(kube_api)
    ns = f"rp-preflight-{secrets.token_hex(2)}"
    core.create_namespace({"metadata": {"name": ns, "labels": {"rayproof.io/run": run_id, "rayproof.io/test": ns}}})
    try:
        wait_for(lambda: core.read_namespaced_service_account("default", ns), timeout=timeouts.CONTROLLER_RECONCILE,
                 description=f"the default service account of {ns}")
        token = core.create_namespaced_service_account_token("default", ns, {"spec": {"expirationSeconds": 600}})
        yield token.status.token
    finally:
        core.delete_namespace(ns)


def test_missing_rbac_lists_the_denied_verbs_and_creates_nothing(target, kube_api, unprivileged_token, tmp_path) -> None:
    kc = _kubeconfig_with(target, tmp_path, token=unprivileged_token)
    before = _namespaces(kube_api)
    with pytest.raises(pf.PreflightError) as exc:
        pf.preflight(config.new_client_from_config(config_file=str(kc)), profile_mod.load())
    text = str(exc.value)
    assert "may not do what the certification does: cannot create namespaces" in text, text
    assert "create ray.io/rayjobs" in text and "cluster-admin" in text, text
    assert _namespaces(kube_api) == before


def test_profile_naming_missing_objects_is_rejected(kube_api) -> None:
    profile = profile_mod.load({"kueue": {"priorityClasses": {"high": "no-such-class"}},
                                "training": {"checkpoints": {"storageClassName": "no-such-storage"}}})
    with pytest.raises(pf.PreflightError) as exc:
        pf.preflight(kube_api, profile)
    text = str(exc.value)
    assert "WorkloadPriorityClass 'no-such-class' does not exist" in text, text
    assert "StorageClass 'no-such-storage' does not exist" in text, text


def test_the_embedded_platform_passes_preflight(kube_api) -> None:
    found = pf.preflight(kube_api, profile_mod.load())
    assert found["kubernetes"].startswith("v1."), found


def test_platform_health_in_failure_evidence_names_a_dead_process_and_its_log(target, monkeypatch) -> None:
    """What a failed test's evidence says of the platform: all well here; and,
    for a process reported dead, its name and its log's last lines."""
    text = target.diagnose()
    assert "nodes Ready, none under pressure" in text and "processes healthy" in text, text
    if target.kind != "embedded":
        return
    rec = target.platform.supervisor.records()[0]
    health = {**target.platform.health(), rec.name: "not running"}
    monkeypatch.setattr(target.platform, "health", lambda: health)
    text = target.diagnose()
    last_line = Path(rec.log).read_text(errors="replace").splitlines()[-1]
    assert f"unhealthy {{'{rec.name}': 'not running'}}" in text and f"--- {rec.name} (PID {rec.pid})" in text, text
    assert last_line in text, text
