"""The whole embedded platform, end to end: KubeRay running real Ray on its nodes' pods.

Uses the session's platform (the one the clauses certify; brought up and
taken down by the ``target`` fixture). Every object lives in a namespace made
for this module and labelled with its run id. Kueue gang admission and
NetworkPolicy enforcement on this platform are what clauses ADM-1/ADM-2 and
NET-3 check, so they are not repeated here.
"""
from __future__ import annotations

import json
import secrets
import subprocess
import time
from typing import Any, Iterator

import pytest
from kubernetes import client

from clusters.embedded import build
from clusters.embedded.platform import EmbeddedPlatform
from core import timeouts
from core.waiting import wait_for
from fixtures.sharing import host_slot

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
def platform(target) -> EmbeddedPlatform:
    """Module scope; the session's embedded platform (its teardown is the session's)."""
    if getattr(target, "kind", None) != "embedded":
        pytest.fail("these tests exercise the embedded platform; run them without --kubeconfig")
    return target.platform


@pytest.fixture(autouse=True)
def _host_slot() -> Iterator[None]:
    """Function scope; the Ray clusters these tests start run on this machine: one of its host slots."""
    with host_slot():
        yield


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


def test_the_pinned_kubectl_lists_the_nodes_and_the_ray_crds(platform: EmbeddedPlatform) -> None:
    """The kubectl `up` tells its users to use: the pinned release, against the platform's kubeconfig."""
    kubectl = [str(platform.binaries()["kubectl"]), f"--kubeconfig={platform.kubeconfig}"]
    version = json.loads(subprocess.run([*kubectl, "version", "-o", "json"], capture_output=True, text=True,
                                        check=True, timeout=60).stdout)
    pinned = build.pinned_versions()["kubernetes"]
    assert version["clientVersion"]["gitVersion"] == pinned and version["serverVersion"]["gitVersion"] == pinned, \
        version
    nodes = subprocess.run([*kubectl, "get", "nodes", "-o", "name"], capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()
    assert len(nodes) == platform.profile.node_count, nodes
    kinds = subprocess.run([*kubectl, "api-resources", "--api-group=ray.io", "-o", "name"], capture_output=True,
                           text=True, check=True, timeout=60).stdout.split()
    assert {"rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io"} <= set(kinds), kinds


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
