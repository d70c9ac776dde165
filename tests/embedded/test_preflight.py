"""Preflight: each way a cluster cannot be certified gives one message saying
what to do, and nothing is created (against the embedded platform)."""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client, config

from clusters import access
from clusters import preflight as pf
from core import profile as profile_mod
from core import timeouts
from core.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every request this process sends that could change the cluster (a
    method other than GET), but for the self-subject reviews preflight asks;
    other tests' namespaces, made meanwhile on the shared platform, are not
    in it."""
    import threading

    seen: list[str] = []
    call_api = client.ApiClient.call_api
    test_thread = threading.current_thread()  # not the run lease's renewals

    def recording(self, method, url, *args, **kwargs):  # the client's call_api(method, url, ...)
        if threading.current_thread() is test_thread and method.upper() != "GET" and "selfsubject" not in url:
            seen.append(f"{method} {url}")
        return call_api(self, method, url, *args, **kwargs)

    monkeypatch.setattr(client.ApiClient, "call_api", recording)
    return seen


def _contents(api: Any, namespace: str) -> set[str]:
    """What a namespace holds that an identity admin of it could have made."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    found = {f"pod/{o.metadata.name}" for o in core.list_namespaced_pod(namespace).items}
    found |= {f"configmap/{o.metadata.name}" for o in core.list_namespaced_config_map(namespace).items}
    found |= {f"pvc/{o.metadata.name}" for o in core.list_namespaced_persistent_volume_claim(namespace).items}
    found |= {f"lease/{o.metadata.name}" for o in client.CoordinationV1Api(api).list_namespaced_lease(namespace).items}
    for plural in ("rayjobs", "rayclusters", "rayservices"):
        found |= {f"{plural}/{o['metadata']['name']}"
                  for o in custom.list_namespaced_custom_object("ray.io", "v1", namespace, plural)["items"]}
    return found


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


def test_missing_api_names_what_to_install_and_creates_nothing(kube_api, monkeypatch, writes) -> None:
    monkeypatch.setattr(pf, "REQUIRED_APIS", (*pf.REQUIRED_APIS,
                                              ("ray.io", "v1", "rayfoos", "a KubeRay with RayFoos"),
                                              ("kueue.x-k8s.io", "v9", "clusterqueues", "Kueue v9")))
    with pytest.raises(pf.PreflightError) as exc:
        pf.preflight(kube_api, profile_mod.load())
    text = str(exc.value)
    assert "ray.io/v1 rayfoos (install a KubeRay with RayFoos)" in text and "kueue.x-k8s.io/v9 clusterqueues" in text, text
    assert "rayclusters" not in text, f"served APIs reported missing: {text}"
    assert writes == []


def _service_account_token(target, run_id: str, *, namespaced_admin: bool) -> Iterator[tuple[str, str]]:
    """A token of a service account and its namespace of its own (deleted at
    teardown), made with the platform's admin identity as a cluster's admins
    would; with ``namespaced_admin`` it may do anything in that namespace
    (a RoleBinding to ``admin``), else nothing at all."""
    admin = target.platform.api_client()
    core = client.CoreV1Api(admin)
    ns = f"rp-preflight-{secrets.token_hex(2)}"
    core.create_namespace({"metadata": {"name": ns, "labels": {"rayproof.io/run": run_id, "rayproof.io/test": ns}}})
    try:
        wait_for(lambda: core.read_namespaced_service_account("default", ns), timeout=timeouts.CONTROLLER_RECONCILE,
                 description=f"the default service account of {ns}")
        if namespaced_admin:
            client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(ns, {
                "metadata": {"name": "team-admin"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"},
                "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]})
        token = core.create_namespaced_service_account_token("default", ns, {"spec": {"expirationSeconds": 600}})
        yield token.status.token, ns
    finally:
        core.delete_namespace(ns)


@pytest.fixture
def unprivileged_token(target, run_id: str) -> Iterator[str]:
    """A service account with no role bindings."""
    for token, _ in _service_account_token(target, run_id, namespaced_admin=False):
        yield token


@pytest.fixture
def namespace_admin_token(target, run_id: str) -> Iterator[tuple[str, str]]:
    """A service account that is admin of its own namespace (token, namespace), no cluster-wide access."""
    yield from _service_account_token(target, run_id, namespaced_admin=True)


def test_missing_rbac_lists_the_denied_verbs_and_creates_nothing(target, kube_api, unprivileged_token, tmp_path,
                                                                writes) -> None:
    kc = _kubeconfig_with(target, tmp_path, token=unprivileged_token)
    with pytest.raises(pf.PreflightError) as exc:
        pf.preflight(config.new_client_from_config(config_file=str(kc)), profile_mod.load())
    text = str(exc.value)
    assert "may not do what the certification does: cannot create namespaces" in text, text
    assert "create rbac.authorization.k8s.io/rolebindings" in text and "clusters/rbac/rayproof-certifier.yaml" in text, \
        text
    assert writes == []


def test_certify_with_a_namespaced_role_only_is_refused_naming_the_missing_verbs(target, kube_api, namespace_admin_token,
                                                                                 tmp_path) -> None:
    """Admin of one namespace is not enough: the suite creates its own
    namespaces. `certify` exits with preflight's status, names what is
    missing, and creates nothing."""
    import subprocess
    import sys

    from rayproof.cli import PREFLIGHT_EXIT

    token, own = namespace_admin_token
    kc = _kubeconfig_with(target, tmp_path, token=token)
    admin = target.platform.api_client()
    before = _contents(admin, own)
    proc = subprocess.run([sys.executable, "-m", "rayproof", "certify", "--kubeconfig", str(kc), "-k", "NET-3",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    output = proc.stdout + proc.stderr
    assert proc.returncode == PREFLIGHT_EXIT, f"exit {proc.returncode}:\n{output[-3000:]}"
    for missing in ("create namespaces", "list nodes", "list ray.io/rayjobs",
                    "create rbac.authorization.k8s.io/rolebindings", "list apps/deployments"):
        assert missing in output, f"{missing!r} not named:\n{output[-3000:]}"
    assert "a namespaced Role is not enough" in output, output[-3000:]
    # RBAC lets it create namespaces nowhere; the one namespace it may write in holds what it held.
    assert _contents(admin, own) == before


def test_the_certifying_identity_is_the_shipped_role_and_nothing_more(target, kube_api) -> None:
    """The embedded platform certifies as user rayproof-certifier, bound to
    the shipped cluster-wide role only: every certification of it runs with
    exactly that access (and the run's role where it binds it), which reads
    no Secret and binds no other role."""
    review = client.AuthenticationV1Api(kube_api).create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    assert review.status.user_info.username == "rayproof-certifier", review.status.user_info
    assert not pf.denied_access(kube_api, access.checks())
    beyond = [("get", "", "secrets", "", ""), ("list", "", "secrets", "", ""),
              ("create", "rbac.authorization.k8s.io", "clusterrolebindings", "", ""), ("delete", "", "nodes", "", ""),
              ("create", "scheduling.k8s.io", "priorityclasses", "", ""),
              ("patch", "kueue.x-k8s.io", "clusterqueues", "", ""),
              ("bind", "rbac.authorization.k8s.io", "clusterroles", "", "admin")]
    assert pf.denied_access(kube_api, beyond) == [
        "get secrets", "list secrets", "create rbac.authorization.k8s.io/clusterrolebindings", "delete nodes",
        "create scheduling.k8s.io/priorityclasses", "patch kueue.x-k8s.io/clusterqueues",
        "bind rbac.authorization.k8s.io/clusterroles admin"]


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


def _profile_with_worker(tmp_path: Path, change: Any) -> Any:
    """The default profile with its golden RayJob template's worker pod changed by ``change``."""
    golden = Path(pf.__file__).resolve().parent / "embedded" / "golden" / "rayjob.yaml"
    template = yaml.safe_load(golden.read_text())
    change(template["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"])
    (tmp_path / "rayjob.yaml").write_text(yaml.safe_dump(template))
    return profile_mod.load({"templates": {"rayJob": str(tmp_path / "rayjob.yaml")}})


def test_a_gang_that_fits_no_node_is_refused_naming_its_shape(kube_api, tmp_path) -> None:
    def sixteen_gpus(pod: dict) -> None:
        for part in ("requests", "limits"):
            pod["containers"][0]["resources"][part]["nvidia.com/gpu"] = "16"

    profile = _profile_with_worker(tmp_path, sixteen_gpus)
    with pytest.raises(pf.PreflightError, match=r"not one gang .* 2 workers of .*16 nvidia.com/gpu each, .* hold 0"):
        pf.preflight(kube_api, profile)


def test_nodes_whose_taints_the_workers_do_not_tolerate_hold_none(kube_api, tmp_path, monkeypatch) -> None:
    from kubernetes.client import V1Taint

    nodes = client.CoreV1Api(kube_api).list_node().items
    for node in nodes:
        node.spec.taints = [V1Taint(key="tenant", value="other", effect="NoSchedule")]
    listing = type("NodeList", (), {"items": nodes})
    monkeypatch.setattr(client.CoreV1Api, "list_node", lambda self, **kw: listing)
    assert pf.workers_that_fit(kube_api, profile_mod.load()) == 0

    def tolerate(pod: dict) -> None:
        pod["tolerations"] = [{"key": "tenant", "operator": "Equal", "value": "other", "effect": "NoSchedule"}]

    assert pf.workers_that_fit(kube_api, _profile_with_worker(tmp_path, tolerate)) == len(nodes)


def test_an_operator_installed_but_down_or_too_old_is_refused(kube_api, monkeypatch) -> None:
    from kubernetes.client import (
        V1Container,
        V1Deployment,
        V1DeploymentSpec,
        V1DeploymentStatus,
        V1LabelSelector,
        V1ObjectMeta,
        V1PodSpec,
        V1PodTemplateSpec,
    )

    def deployment(name: str, image: str, available: int) -> V1Deployment:
        return V1Deployment(metadata=V1ObjectMeta(name=name, namespace="ops"), status=V1DeploymentStatus(
            available_replicas=available), spec=V1DeploymentSpec(replicas=1, selector=V1LabelSelector(),
            template=V1PodTemplateSpec(spec=V1PodSpec(containers=[V1Container(name="m", image=image)]))))

    from clusters import existing
    monkeypatch.setattr(existing, "operator_deployments", lambda api: {
        "kuberay": [deployment("kuberay-operator", "quay.io/kuberay/operator:v1.2.2", 1)],
        "kueue": [deployment("kueue-controller-manager", "registry.k8s.io/kueue/kueue:v0.17.0", 0)]})
    with pytest.raises(pf.PreflightError) as exc:
        pf.preflight(kube_api, profile_mod.load())
    text = str(exc.value)
    assert "kueue: Deployment ops/kueue-controller-manager (0 of 1 replicas available) is installed but not " \
           "running" in text, text
    assert "kuberay: ops/kuberay-operator runs v1.2.2, older than v1.3.0" in text, text
    assert "kueue-controller-manager runs" not in text, "v0.17.0 is new enough"


# `kubectl auth can-i` as the certifier, outside any run's namespace: each a
# write (or a read of another's pods' logs) the certification must not have there.
OUTSIDE = "kube-system"
WRITES_ELSEWHERE = [
    ("delete", "namespace/kube-system", OUTSIDE), ("create", "pods", OUTSIDE), ("delete", "pods", OUTSIDE),
    ("deletecollection", "pods", OUTSIDE), ("get", "pods --subresource=log", OUTSIDE), ("create", "secrets", OUTSIDE),
    ("patch", "leases.coordination.k8s.io", OUTSIDE), ("patch", "leases.coordination.k8s.io", "kube-node-lease"),
    ("create", "services", OUTSIDE), ("list", "jobs.batch", OUTSIDE), ("list", "events", OUTSIDE),
    ("create", "networkpolicies.networking.k8s.io", "{stranger}"),
    ("delete", "networkpolicies.networking.k8s.io", "{stranger}"),
    ("patch", "rayclusters.ray.io", "{stranger}"), ("delete", "rayjobs.ray.io", "{stranger}"),
    ("create", "configmaps", "default"),
]


def test_the_certifier_may_write_only_in_namespaces_its_runs_made(target, kube_api, run_id: str) -> None:
    """RBAC: `kubectl auth can-i` as the certifier answers no for every write
    outside a run's namespaces, and yes in one its run made and bound the
    run's role in. The guard (a ValidatingAdmissionPolicy): the two writes
    RBAC must allow everywhere (a labelled namespace, a RoleBinding of the
    run's role) are refused outside a run, and a pod on its node's network is
    refused inside one (each a dry run: admission runs, nothing is stored)."""
    import subprocess

    def can_i(verb: str, what: str, namespace: str) -> bool:
        done = subprocess.run([str(target.platform.binaries()["kubectl"]),
                               f"--kubeconfig={target.platform.certifier_kubeconfig}", "auth", "can-i", verb,
                               *what.split(), "-n", namespace], capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() in ("yes", "no"), (verb, what, namespace, done.stdout, done.stderr)
        return done.stdout.strip() == "yes"

    core = client.CoreV1Api(kube_api)
    rbac = client.RbacAuthorizationV1Api(kube_api)
    admin = client.CoreV1Api(target.platform.api_client())
    stranger = f"rp-{run_id}-stranger"  # another tenant's namespace: no run label
    admin.create_namespace({"metadata": {"name": stranger}})
    binding = {"metadata": {"name": access.RUN_ROLE_NAME},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": access.RUN_ROLE_NAME},
               "subjects": [access.subject(kube_api)]}
    pod = {"metadata": {"name": "reads-a-secret"}, "spec": {"containers": [{"name": "c", "image": "busybox"}],
                                                           "volumes": [{"name": "s", "secret": {"secretName": "x"}}]}}
    with pytest.raises(client.ApiException) as refused_pod:  # RBAC refuses it before admission sees it
        core.create_namespaced_pod(OUTSIDE, pod, dry_run="All")
    assert refused_pod.value.status == 403, refused_pod.value.body
    refused = {
        "binding the run's role in kube-system": lambda: rbac.create_namespaced_role_binding(
            OUTSIDE, binding, dry_run="All"),
        "binding the run's role in another tenant's namespace": lambda: rbac.create_namespaced_role_binding(
            stranger, binding, dry_run="All"),
        "a namespace without a run label": lambda: core.create_namespace({"metadata": {"name": f"rp-{run_id}-bare"}},
                                                                          dry_run="All"),
    }
    let_through = []
    try:
        allowed = [(verb, what, ns) for verb, what, ns in WRITES_ELSEWHERE
                   if can_i(verb, what, ns.format(stranger=stranger))]
        for what, write in refused.items():
            try:
                write()
                let_through.append(what)
            except client.ApiException as exc:
                assert exc.status in (403, 422) and "rayproof-certifier-confinement" in (exc.body or ""), (what, exc.body)
    finally:
        admin.delete_namespace(stranger)
    assert allowed == [] and let_through == []
    assert access.write_let_through(kube_api) is None
    ns = f"rp-{run_id}-guard"
    core.create_namespace({"metadata": {"name": ns, "labels": {"rayproof.io/run": run_id}}})
    try:
        assert not can_i("create", "pods", ns), "the run's role before the run bound it"
        access.bind_run_role(kube_api, ns, {"rayproof.io/run": run_id})
        assert [(verb, what) for verb, what in (("create", "pods"), ("delete", "namespace/" + ns),
                                                 ("create", "networkpolicies.networking.k8s.io"))
                if not can_i(verb, what, ns)] == []
        core.create_namespaced_config_map(ns, {"metadata": {"name": "x"}}, dry_run="All")
        on_the_node = {"metadata": {"name": "p"}, "spec": {"hostNetwork": True, "containers": [
            {"name": "c", "image": "busybox"}]}}
        with pytest.raises(client.ApiException, match="rayproof-certifier-confinement"):
            core.create_namespaced_pod(ns, on_the_node, dry_run="All")
    finally:
        core.delete_namespace(ns)
