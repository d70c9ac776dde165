"""The embedded platform comes up, works end to end, and goes away cleanly.

Real processes, no mocks: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, the KubeRay operator and Kueue, from the binaries pinned in
``clusters/embedded/versions.toml`` (built once by
``clusters.embedded.build.ensure_built``; a cold build takes tens of minutes).

One platform serves the whole module (bringing it up costs tens of seconds of
both cores); the last test takes it down and checks that nothing is left, and
the fixture downs it again whatever happened.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from clusters.embedded import build
from clusters.embedded.addons import ADDON_PROCESSES
from clusters.embedded.controlplane import PROCESS_ORDER, listening_ports
from clusters.embedded.platform import EmbeddedPlatform
from core import timeouts
from core.waiting import wait_for
from fixtures.netns import list_namespaces
from fixtures.sharing import host_slot

pytestmark = pytest.mark.slow

KUEUE = ("kueue.x-k8s.io", "v1beta2")
RAY_CRDS = ("rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io")


class Started:
    """The platform under test and what its start cost."""

    def __init__(self, platform: EmbeddedPlatform, up_s: float):
        self.platform = platform
        self.up_s = up_s
        self.api = platform.api_client()


# One node, no image pre-pulled: these tests are of the control plane and the operators, which need no pods
# of their own, and a test run's other platforms leave room on this machine for a small one.
ONE_NODE = {"nodes": {"count": 1, "prepullImages": []}}


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """Module scope: one embedded platform in a temporary run directory, started
    in one of the machine's host slots; down() at teardown, always."""
    binaries = build.ensure_built(progress=print)  # outside the timing: the warm figure excludes builds
    run_dir = tmp_path_factory.mktemp("embedded") / "platform"
    platform = EmbeddedPlatform(f"test-{os.getpid()}", run_dir=run_dir, binaries=binaries, progress=print,
                                profile=ONE_NODE)
    try:
        platform.wait_for_room()  # outside the slot, and outside the timing
        with host_slot():  # the wait for it is outside the timing too
            t0 = time.monotonic()
            platform.up(wait_for_room=True)
            s = Started(platform, time.monotonic() - t0)
        yield s
        s.api.close()
    finally:
        platform.down()


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _crd_conditions(api: Any) -> dict[str, dict[str, str]]:
    resp = client.ApiextensionsV1Api(api).list_custom_resource_definition(_preload_content=False)
    items = json.loads(resp.data)["items"]
    return {
        i["metadata"]["name"]: {c["type"]: c["status"] for c in (i.get("status") or {}).get("conditions") or []}
        for i in items
    }


def test_warm_up_time_and_memory(started: Started, evidence: Any) -> None:
    """Reports how long a warm ``up`` took (binaries cached) until KubeRay,
    Kueue, the pod network and the nodes were ready, and the resident memory
    of the control plane and of the whole platform."""
    rss = started.platform.rss_bytes()
    cp_rss = sum(v for k, v in rss.items() if k in PROCESS_ORDER)
    all_rss = sum(rss.values())
    evidence.record("warm_up_s", round(started.up_s, 1))
    evidence.record("control_plane_rss_mib", round(cp_rss / 2**20))
    evidence.record("platform_rss_mib", round(all_rss / 2**20))
    evidence.record("rss_mib_by_process", {k: round(v / 2**20) for k, v in rss.items()})
    print(f"\nwarm up (control plane, KubeRay, Kueue, pod network, nodes ready): {started.up_s:.1f}s; "
          f"control plane RSS {cp_rss / 2**20:.0f} MiB, with operators {all_rss / 2**20:.0f} MiB: "
          + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in rss.items()))
    assert set(rss) == {*PROCESS_ORDER, *ADDON_PROCESSES, *started.platform.node_layer_processes()}, \
        f"running processes: {sorted(rss)}"


def test_api_server_reports_the_pinned_version(started: Started) -> None:
    """GET /version answers with the Kubernetes version pinned in versions.toml."""
    pinned = build.pinned_versions()["kubernetes"]
    version = client.VersionApi(started.api).get_code()
    assert version.git_version == pinned, f"server says {version.git_version}, versions.toml pins {pinned}"
    assert f"{version.major}.{version.minor}" == pinned.lstrip("v").rsplit(".", 1)[0]


def test_crds_are_established(started: Started) -> None:
    """Every KubeRay and Kueue CRD from the pinned manifests is Established."""
    manifests = build.ensure_built(progress=print)["manifests"]
    kueue = sorted(yaml.safe_load(f.read_text())["metadata"]["name"]
                   for f in (manifests / "kueue" / "crd").glob("*.yaml"))
    assert "clusterqueues.kueue.x-k8s.io" in kueue and "workloads.kueue.x-k8s.io" in kueue, kueue
    conditions = _crd_conditions(started.api)
    not_established = {n: conditions.get(n) for n in (*RAY_CRDS, *kueue)
                       if conditions.get(n, {}).get("Established") != "True"}
    assert not not_established, f"CRDs not Established (name: conditions): {not_established}"


def test_operators_are_running_and_ready(started: Started) -> None:
    """KubeRay and Kueue run as the recorded processes and answer their readiness probes."""
    status = started.platform.status()
    assert status["phase"] == "running", status
    for name in ADDON_PROCESSES:
        proc = status["processes"].get(name)
        assert proc and proc["running"] and proc["health"] == "ok", f"{name}: {proc}"
    assert status["healthy"], status["health"]


def test_kueue_webhooks_admit_valid_and_reject_invalid_queues(started: Started) -> None:
    """ResourceFlavor, ClusterQueue and LocalQueue are admitted through Kueue's
    webhooks and the ClusterQueue turns Active; an invalid ClusterQueue is
    rejected by Kueue's validating webhook (not by the CRD schema); the
    conversion webhook serves the ClusterQueue as v1beta1."""
    co = client.CustomObjectsApi(started.api)
    core = client.CoreV1Api(started.api)
    flavor, cq_name, ns = _unique("flavor"), _unique("cq"), _unique("queues")
    cleanup: list[Any] = []
    try:
        co.create_cluster_custom_object(*KUEUE, "resourceflavors", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}})
        cleanup.append(lambda: co.delete_cluster_custom_object(*KUEUE, "resourceflavors", flavor))
        cq = {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq_name},
            "spec": {"namespaceSelector": {}, "resourceGroups": [{
                "coveredResources": ["cpu", "memory"],
                "flavors": [{"name": flavor, "resources": [
                    {"name": "cpu", "nominalQuota": "4"}, {"name": "memory", "nominalQuota": "8Gi"}]}],
            }]},
        }
        co.create_cluster_custom_object(*KUEUE, "clusterqueues", cq)
        cleanup.append(lambda: co.delete_cluster_custom_object(*KUEUE, "clusterqueues", cq_name))
        core.create_namespace({"metadata": {"name": ns}})
        cleanup.append(lambda: core.delete_namespace(ns))
        co.create_namespaced_custom_object(*KUEUE, ns, "localqueues", {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "main"},
            "spec": {"clusterQueue": cq_name}})

        def cq_active() -> dict[str, str]:
            obj = co.get_cluster_custom_object(*KUEUE, "clusterqueues", cq_name)
            return {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}

        wait_for(cq_active, lambda c: c.get("Active") == "True", timeout=timeouts.CONTROLLER_RECONCILE,
                 description=f"ClusterQueue {cq_name} to be Active")

        old = co.get_cluster_custom_object("kueue.x-k8s.io", "v1beta1", "clusterqueues", cq_name)
        assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1", old["apiVersion"]

        bad = json.loads(json.dumps(cq))
        bad["metadata"]["name"] = _unique("cq-invalid")
        # Same number of resources as coveredResources (the CRD's CEL rule
        # passes) but a different name, which only Kueue's webhook checks.
        bad["spec"]["resourceGroups"][0]["flavors"][0]["resources"][1]["name"] = "nvidia.com/gpu"
        with pytest.raises(ApiException) as err:
            co.create_cluster_custom_object(*KUEUE, "clusterqueues", bad)
        message = json.loads(err.value.body or "{}").get("message", "")
        assert 'admission webhook "vclusterqueue.kb.io" denied the request' in message, err.value.body
        assert "must match the name in coveredResources" in message, err.value.body
    finally:
        for undo in reversed(cleanup):
            try:
                undo()
            except ApiException as exc:
                if exc.status != 404:
                    raise


def test_namespace_is_created_populated_and_deleted(started: Started) -> None:
    """A new namespace gets its default service account and kube-root-ca.crt
    (service-account and root-CA publisher controllers), and a deleted one is
    finalized and gone (namespace controller)."""
    core = client.CoreV1Api(started.api)
    ns = _unique("ns")
    core.create_namespace({"metadata": {"name": ns}})
    try:
        wait_for(lambda: (core.read_namespaced_service_account("default", ns).metadata.name,
                          core.read_namespaced_config_map("kube-root-ca.crt", ns).metadata.name),
                 timeout=timeouts.CONTROLLER_RECONCILE,
                 description=f"service account default and ConfigMap kube-root-ca.crt in namespace {ns}",
                 ignore=(ApiException,))
        core.create_namespaced_config_map(ns, {"metadata": {"name": "payload"}, "data": {"k": "v"}})
    finally:
        core.delete_namespace(ns)

    def phase() -> str:
        try:
            return core.read_namespace(ns).status.phase
        except ApiException as exc:
            if exc.status == 404:
                return "gone"
            raise

    wait_for(phase, lambda p: p == "gone", timeout=timeouts.OBJECT_DELETE,
             description=f"namespace {ns} to be finalized and deleted")


def test_second_up_reuses_the_running_platform(started: Started) -> None:
    """up() on a healthy running platform changes nothing: same PIDs, same start."""
    p = started.platform
    before = {r.name: r.pid for r in p.supervisor.records()}
    started_at = p.state.read()["started_at"]
    again = EmbeddedPlatform(p.name, run_dir=p.run_dir, binaries=p.binaries(), profile=ONE_NODE).up()
    after = {r.name: r.pid for r in again.supervisor.records()}
    assert after == before, f"PIDs before {before}, after {after}"
    assert again.state.read()["started_at"] == started_at


def test_down_leaves_no_process_port_or_directory(started: Started, tmp_path: Path) -> None:
    """down() stops every process, frees every port, runs the registered
    cleanups and removes the run directory; a second down() has nothing left
    to do."""
    p = started.platform
    outside = tmp_path / "made-outside-the-run-dir"
    outside.mkdir()
    p.register_cleanup("shutil:rmtree", path=str(outside), ignore_errors=True)
    records = p.supervisor.records()
    pids = {r.name: r.pid for r in records}
    ports = set(p.state.read()["ports"].values())
    assert ports and ports <= p.listening_ports(), f"recorded {sorted(ports)}, listening {sorted(p.listening_ports())}"
    run_dir = Path(p.run_dir)

    p.down()

    alive = {n: pid for n, pid in pids.items() if any(r.pid == pid and r.identity_ok() for r in records)}
    assert not alive, f"still running after down(): {alive}"
    still = ports & listening_ports()
    assert not still, f"ports still listening after down(): {sorted(still)}"
    assert not run_dir.exists(), f"{run_dir} still exists: {sorted(str(x) for x in run_dir.rglob('*'))[:20]}"
    assert not outside.exists(), f"registered cleanup did not remove {outside}"
    left_ns = list_namespaces(f"rayproof-{p.name}-")
    assert not left_ns, f"network namespaces of platform {p.name} left after down(): {left_ns}"
    assert p.down() == []
    assert p.status()["phase"] == "absent"
