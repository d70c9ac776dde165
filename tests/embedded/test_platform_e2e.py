"""The whole embedded platform, end to end: KubeRay and Kueue running real Ray on node-agent pods.

One platform for the module (control plane, KubeRay, Kueue, pod network,
four node agents), always brought down at the end.  Every object lives in a
namespace made for this module and labelled with its run id.
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Iterator

import pytest
from kubernetes import client

from clusters.embedded import build
from clusters.embedded.platform import EmbeddedPlatform
from fixtures import timeouts
from fixtures.waiting import wait_for

pytestmark = pytest.mark.slow

RUN = secrets.token_hex(3)
LABELS = {"rayproof.io/run": RUN}
RAY_IMAGE = "rayproject/ray:2.60.0"


def ray_container(name: str, cpu: str = "500m", gpus: int = 0) -> dict:
    limits: dict[str, str] = {"cpu": "1", "memory": "2Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"name": name, "image": RAY_IMAGE,
            "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}],
            "resources": {"limits": limits, "requests": {**limits, "cpu": cpu, "memory": "1Gi"}}}


def ray_cluster_spec(workers: int = 2, gpus_per_worker: int = 0) -> dict:
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                          "template": {"metadata": {"labels": LABELS},
                                       "spec": {"containers": [ray_container("ray-head")]}}},
        "workerGroupSpecs": [{
            "groupName": "workers", "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
            "rayStartParams": {},
            "template": {"metadata": {"labels": LABELS},
                         "spec": {"containers": [ray_container("ray-worker", gpus=gpus_per_worker)]}},
        }],
    }


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPlatform]:
    """Module scope; the whole embedded platform, downed at teardown whatever happened."""
    p = EmbeddedPlatform(f"e2e-{RUN}", run_dir=tmp_path_factory.mktemp("platform") / "run", progress=print)
    try:
        p.up()
        yield p
    finally:
        p.down()


@pytest.fixture(scope="module")
def api(platform: EmbeddedPlatform) -> client.ApiClient:
    return platform.api_client()


@pytest.fixture(scope="module")
def namespace(api: client.ApiClient) -> Iterator[str]:
    """Module scope; a labelled namespace, deleted (and waited for) at teardown."""
    core = client.CoreV1Api(api)
    name = f"rayproof-e2e-{RUN}"
    core.create_namespace({"metadata": {"name": name, "labels": LABELS}})
    yield name
    core.delete_namespace(name)
    wait_for(lambda: [n.metadata.name for n in core.list_namespace().items if n.metadata.name == name],
             lambda left: not left, timeout=timeouts.OBJECT_DELETE, description=f"namespace {name} to be deleted")


def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def get_ray(api, namespace: str, plural: str, name: str) -> dict:
    return custom(api).get_namespaced_custom_object("ray.io", "v1", namespace, plural, name)


def pods(api, namespace: str, selector: str) -> list[Any]:
    return client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items


def test_nodes_ready_with_gpu_capacity_and_pinned_version(platform: EmbeddedPlatform, api) -> None:
    nodes = client.CoreV1Api(api).list_node().items
    ready = [n for n in nodes if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions)]
    assert len(ready) == platform.profile.node_count, [n.metadata.name for n in nodes]
    gpus = {n.metadata.name: n.status.capacity.get("nvidia.com/gpu") for n in ready}
    assert all(v == platform.profile.node_shape["nvidia.com/gpu"] for v in gpus.values()), gpus
    version = client.VersionApi(api).get_code().git_version
    assert version == build.pinned_versions()["kubernetes"], version


def test_raycluster_with_two_workers_becomes_ready(api, namespace: str, evidence) -> None:
    name = f"rc-{RUN}"
    body = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "namespace": namespace, "labels": LABELS}, "spec": ray_cluster_spec()}
    began = time.monotonic()
    custom(api).create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", body)
    try:
        status = wait_for(lambda: get_ray(api, namespace, "rayclusters", name).get("status", {}),
                          lambda s: s.get("state") == "ready" and s.get("readyWorkerReplicas") == 2,
                          timeout=timeouts.RAYCLUSTER_READY, description=f"RayCluster {name} ready with 2 workers", interval=2)
        evidence.record("raycluster_ready_s", round(time.monotonic() - began, 1))
        assert status["head"]["podIP"].startswith("198.18."), status["head"]
    finally:
        custom(api).delete_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", name)
    wait_for(lambda: pods(api, namespace, f"ray.io/cluster={name}"), lambda left: not left,
             timeout=timeouts.OBJECT_DELETE, description=f"pods of RayCluster {name} to be deleted")


ENTRYPOINT = ("python -c \"import json, ray; ray.init(); "
              "print('RAYPROOF_NODES', sum(1 for n in ray.nodes() if n['Alive'])); "
              "print('RAYPROOF_RESOURCES', json.dumps(ray.cluster_resources()))\"")


def rayjob(name: str, namespace: str, entrypoint: str, *, queue: str | None = None, gpus_per_worker: int = 0) -> dict:
    labels = dict(LABELS)
    if queue:
        labels["kueue.x-k8s.io/queue-name"] = queue
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"entrypoint": entrypoint, "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 0,
                     "suspend": bool(queue),
                     "rayClusterSpec": ray_cluster_spec(gpus_per_worker=gpus_per_worker)}}


def job_status(api, namespace: str, name: str) -> dict:
    return get_ray(api, namespace, "rayjobs", name).get("status", {})


def test_rayjob_sees_three_nodes_and_its_cluster_is_deleted(api, namespace: str, evidence) -> None:
    name = f"job-{RUN}"
    custom(api).create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs",
                                                rayjob(name, namespace, ENTRYPOINT))
    status = wait_for(lambda: job_status(api, namespace, name),
                      lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                      timeout=timeouts.RAYCLUSTER_READY, description=f"RayJob {name} to finish", interval=2)
    submitter = pods(api, namespace, f"job-name={name}")
    logs = "".join(client.CoreV1Api(api).read_namespaced_pod_log(p.metadata.name, namespace) for p in submitter)
    evidence.record("rayjob_status", {k: status.get(k) for k in ("jobStatus", "jobDeploymentStatus", "reason")})
    assert status.get("jobStatus") == "SUCCEEDED", f"RayJob {name}: {status}; submitter logs:\n{logs[-3000:]}"
    assert "RAYPROOF_NODES 3" in logs, logs[-3000:]
    cluster = status.get("rayClusterName")
    wait_for(lambda: pods(api, namespace, f"ray.io/cluster={cluster}"), lambda left: not left,
             timeout=timeouts.OBJECT_DELETE, description=f"RayJob {name}'s cluster {cluster} to be torn down")
    custom(api).delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)


def test_kueue_keeps_second_gang_suspended_until_quota_frees(api, namespace: str, evidence) -> None:
    kueue = "kueue.x-k8s.io"
    flavor, cq, lq = f"flavor-{RUN}", f"cq-{RUN}", "team"
    objs = custom(api)
    objs.create_cluster_custom_object(kueue, "v1beta2", "resourceflavors",
                                      {"apiVersion": f"{kueue}/v1beta2", "kind": "ResourceFlavor",
                                       "metadata": {"name": flavor, "labels": LABELS}, "spec": {}})
    objs.create_cluster_custom_object(kueue, "v1beta2", "clusterqueues", {
        "apiVersion": f"{kueue}/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq, "labels": LABELS},
        "spec": {"namespaceSelector": {"matchLabels": LABELS}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": flavor, "resources": [{"name": "cpu", "nominalQuota": "32"},
                                                       {"name": "memory", "nominalQuota": "64Gi"},
                                                       {"name": "nvidia.com/gpu", "nominalQuota": "16"}]}]}]}})
    objs.create_namespaced_custom_object(kueue, "v1beta2", namespace, "localqueues", {
        "apiVersion": f"{kueue}/v1beta2", "kind": "LocalQueue", "metadata": {"name": lq, "labels": LABELS},
        "spec": {"clusterQueue": cq}})
    try:
        hold = "python -c \"import ray, time; ray.init(); time.sleep(25); print('RAYPROOF_DONE')\""  # sleep-ok: the job's own run time, holding its gang
        first, second = f"gang-a-{RUN}", f"gang-b-{RUN}"
        for name in (first, second):  # each asks for 2 workers x 8 GPUs = the whole quota
            objs.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs",
                                                 rayjob(name, namespace, hold, queue=lq, gpus_per_worker=8))
        wait_for(lambda: job_status(api, namespace, first), lambda s: s.get("jobStatus") == "RUNNING",
                 timeout=timeouts.RAYCLUSTER_READY, description=f"first gang {first} running", interval=2)
        spec = get_ray(api, namespace, "rayjobs", second)["spec"]
        second_pods = [p.metadata.name for p in pods(api, namespace, "") if p.metadata.name.startswith(second)]
        evidence.record("second_while_first_runs", {"suspend": spec.get("suspend"), "pods": second_pods})
        assert spec.get("suspend") is True and not second_pods, (
            f"{second} was not held by Kueue while {first} used the quota: suspend={spec.get('suspend')}, "
            f"pods={second_pods}")
        wait_for(lambda: job_status(api, namespace, first), lambda s: s.get("jobDeploymentStatus") == "Complete",
                 timeout=timeouts.RAYCLUSTER_READY, description=f"first gang {first} to complete", interval=2)
        status = wait_for(lambda: job_status(api, namespace, second),
                          lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                          timeout=timeouts.RAYCLUSTER_READY, description=f"second gang {second} admitted and finished", interval=2)
        assert status.get("jobStatus") == "SUCCEEDED", f"second gang {second}: {status}"
    finally:
        for name in (f"gang-a-{RUN}", f"gang-b-{RUN}"):
            try:
                objs.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        objs.delete_namespaced_custom_object(kueue, "v1beta2", namespace, "localqueues", lq)
        objs.delete_cluster_custom_object(kueue, "v1beta2", "clusterqueues", cq)
        objs.delete_cluster_custom_object(kueue, "v1beta2", "resourceflavors", flavor)


SERVE_TWO_PORTS = ("import socket, threading\n"
                   "def serve(port):\n"
                   "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                   "    s.bind(('0.0.0.0', port)); s.listen()\n"
                   "    while True: s.accept()[0].close()\n"
                   "threading.Thread(target=serve, args=(7001,), daemon=True).start()\n"
                   "serve(7000)\n")
PROBE = ("import socket, sys\n"
         "for port in (7000, 7001):\n"
         "    try:\n"
         "        socket.create_connection((sys.argv[1], port), timeout=3).close(); print('RAYPROOF_PORT', port, 'open')\n"
         "    except OSError as exc:\n"
         "        print('RAYPROOF_PORT', port, 'blocked', type(exc).__name__)\n")


def test_network_policy_drops_one_port_and_leaves_another_open(api, namespace: str, evidence) -> None:
    core = client.CoreV1Api(api)
    net = client.NetworkingV1Api(api)
    server, probe = f"np-server-{RUN}", f"np-probe-{RUN}"
    core.create_namespaced_pod(namespace, {"metadata": {"name": server, "labels": {**LABELS, "role": "server"}},
                                           "spec": {"containers": [{"name": "srv", "image": "python:3.11",
                                                                    "command": ["python3", "-c", SERVE_TWO_PORTS]}]}})
    net.create_namespaced_network_policy(namespace, {
        "metadata": {"name": f"deny-7000-{RUN}", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"role": "server"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"ports": [{"protocol": "TCP", "port": 7001}]}]}})
    try:
        ip = wait_for(lambda: core.read_namespaced_pod(server, namespace).status, lambda s: s.phase == "Running"
                      and bool(s.pod_ip), timeout=timeouts.POD_START, description=f"pod {server} running").pod_ip
        core.create_namespaced_pod(namespace, {"metadata": {"name": probe, "labels": LABELS}, "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "probe", "image": "python:3.11", "command": ["python3", "-c", PROBE, ip]}]}})
        phase = wait_for(lambda: core.read_namespaced_pod(probe, namespace).status.phase,
                         lambda p: p in ("Succeeded", "Failed"), timeout=timeouts.POD_START,
                         description=f"probe pod {probe} to finish")
        logs = core.read_namespaced_pod_log(probe, namespace)
        evidence.record("probe_output", logs.strip().splitlines())
        assert phase == "Succeeded", f"probe pod {probe} ended {phase}:\n{logs}"
        assert "RAYPROOF_PORT 7000 blocked" in logs, f"port 7000 was not blocked by the policy:\n{logs}"
        assert "RAYPROOF_PORT 7001 open" in logs, f"port 7001 should stay open:\n{logs}"
    finally:
        for name in (server, probe):
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        net.delete_namespaced_network_policy(f"deny-7000-{RUN}", namespace)
