"""The node agent runs pods the way a kubelet does, against the real control plane.

Real processes, no mocks: one embedded platform (etcd, kube-apiserver,
controller manager, scheduler, KubeRay, Kueue) serves the module, with a pod
network (``clusters.embedded.podnet.PodNetwork``) and a node agent of its own
whose nodes carry a unique label; every test pod selects that label, so the
scheduler places it on these nodes (whatever other nodes the platform runs).
Pods are created and observed only through the Kubernetes API, as a user
would; the agent's records are read only to find the processes, cgroups and
namespaces that must be gone afterwards.

The first tests are pure (phase table, ``$(VAR)`` expansion, back-off, image
catalog) and need nothing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from clusters.embedded.nodeagent import catalog
from clusters.embedded.nodeagent import state as st
from clusters.embedded.nodeagent.agent import NodeAgent
from clusters.embedded.nodeagent.envvars import expand
from clusters.embedded.nodeagent.pods import Backoff
from clusters.embedded.nodeagent.status import pod_phase
from core import timeouts
from core.cgroups import V1_ROOT, V2_ROOT
from core.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
NODES = 3
GPUS_PER_NODE = 2


# ---------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------


def test_variable_expansion_follows_kubernetes_rules() -> None:
    env = {"A": "x", "B": "$(A)y"}
    assert expand("$(A)-$(B)", env) == "x-$(A)y"  # values are not expanded twice
    assert expand("$(MISSING) $$(A) $$ $", env) == "$(MISSING) $(A) $ $"
    assert expand("$(A", env) == "$(A"


def test_crash_loop_backoff_doubles_to_the_cap_and_resets_after_ten_minutes() -> None:
    b = Backoff()
    seen, t = [], 0.0
    for _ in range(7):
        b.next(t)
        seen.append(b.duration)
        t += b.duration
    assert seen == [10, 20, 40, 80, 160, 300, 300]
    b.next(t + 601)
    assert b.duration == 10


@pytest.mark.parametrize("ref,entry", [
    ("rayproject/ray:2.60.0", "ray"), ("docker.io/rayproject/ray-ml:2.9.0", "ray"), ("acme/ray-worker:1", "ray"),
    ("redis:7.2", "redis"), ("busybox:1.36", "shell"), ("python:3.11-slim", "python"),
    ("rayproof.local/slow-pull/3/rayproject/ray:2.60.0", "ray"),
])
def test_catalog_resolves_known_images(ref: str, entry: str) -> None:
    img = catalog.lookup(ref)
    assert img.entry == entry, img
    if entry == "ray":
        assert img.forced_env["RAY_USAGE_STATS_ENABLED"] == "0"
        assert img.env["PATH"].startswith(str(Path(sys.executable).parent) + ":")


def test_catalog_refuses_unknown_images_and_parses_slow_pulls() -> None:
    with pytest.raises(catalog.ImageNotFound, match="not found"):
        catalog.lookup("nginx:1.25")
    assert catalog.lookup("rayproof.local/slow-pull/2.5/busybox").pull_seconds == 2.5


def _cs(name: str, state: dict[str, Any], last: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "state": state, "lastState": last or {}}


@pytest.mark.parametrize("policy,state,last,phase", [
    ("Always", {"running": {}}, None, "Running"),
    ("Always", {"waiting": {"reason": "ContainerCreating"}}, None, "Pending"),
    ("Always", {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 137}}, "Running"),
    ("Never", {"terminated": {"exitCode": 0}}, None, "Succeeded"),
    ("Never", {"terminated": {"exitCode": 3}}, None, "Failed"),
    ("OnFailure", {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 1}}, "Running"),
])
def test_phase_table(policy: str, state: dict[str, Any], last: dict[str, Any] | None, phase: str) -> None:
    spec = {"restartPolicy": policy, "containers": [{"name": "c"}]}
    assert pod_phase(spec, [], [_cs("c", state, last)], terminal=False, initialized_once=True) == phase


# ---------------------------------------------------------------------------
# Against the embedded platform
# ---------------------------------------------------------------------------


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("the node agent needs root (network namespaces, memory cgroups, mounts): run as root")


class Env:
    """The platform, its pod network and the agent under test."""

    def __init__(self, platform: Any, podnet: Any, agent: NodeAgent, label: str, up_s: float):
        self.platform = platform
        self.podnet = podnet
        self.agent = agent
        self.label = label
        self.up_s = up_s
        self.api_client = platform.api_client()
        self.core = client.CoreV1Api(self.api_client)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Module scope: an embedded platform, a pod network and a node agent with
    3 nodes (2 GPUs each); agent stopped, network closed, platform downed at teardown."""
    _require_root()
    from clusters.embedded import build
    from clusters.embedded.platform import EmbeddedPlatform
    from clusters.embedded.podnet import PodNetwork

    binaries = build.ensure_built(progress=print)
    base = tmp_path_factory.mktemp("nodeagent")
    tag = uuid.uuid4().hex[:6]
    platform = EmbeddedPlatform(f"natest-{tag}", run_dir=base / "platform", binaries=binaries, progress=print)
    # Each part is undone even where undoing another fails (a run interrupted
    # during this setup once left its platform and network namespace running).
    with contextlib.ExitStack() as undo:
        undo.callback(platform.down)
        platform.up()
        # The platform's down undoes this module's own network and agent too, so `rayproof clean`
        # takes all of it down should this process die (cleanups run last registered first).
        platform.register_cleanup("clusters.embedded.podnet.network:teardown", platform=f"na{tag}",
                                  state_dir=str(base / "podnet"))
        platform.register_cleanup("clusters.embedded.nodeagent.state:cleanup", state_dir=str(base / "agent"))
        podnet = PodNetwork(f"na{tag}", base / "podnet").open()
        undo.callback(podnet.close)
        label = f"natest-{tag}"
        agent = NodeAgent(platform.kubeconfig, {"nodes": {"shape": {"nvidia.com/gpu": GPUS_PER_NODE}}},
                          base / "agent", podnet, nodes=NODES, name_prefix=f"na{tag}-node",
                          labels={"rayproof.dev/test-agent": label})
        undo.callback(agent.stop)
        t0 = time.monotonic()
        agent.start()
        e = Env(platform, podnet, agent, label, time.monotonic() - t0)
        yield e
        e.api_client.close()


@pytest.fixture
def ns(env: Env) -> Iterator[str]:
    """Function scope: a fresh namespace; deleted (and waited for) at teardown."""
    name = f"na-{uuid.uuid4().hex[:6]}"
    env.core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: env.core.read_namespaced_service_account("default", name), timeout=timeouts.CONTROLLER_RECONCILE,
             description=f"service account default in namespace {name}", ignore=(ApiException,))
    try:
        yield name
    finally:
        # Pods first, each through the agent's graceful deletion; the namespace
        # controller then finds nothing left and finishes in one pass (it would
        # otherwise requeue for the pods' grace period).
        env.core.delete_collection_namespaced_pod(name)
        wait_for(lambda: env.core.list_namespaced_pod(name).items, lambda pods: not pods,
                 timeout=timeouts.OBJECT_DELETE, description=f"pods of namespace {name} to be deleted")
        env.core.delete_namespace(name)
        wait_for(lambda: _gone(lambda: env.core.read_namespace(name)), timeout=timeouts.OBJECT_DELETE,
                 description=f"namespace {name} (and its pods) to be deleted")


def _gone(read: Any) -> bool:
    try:
        read()
        return False
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise


def _pod(env: Env, name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"nodeSelector": {"rayproof.dev/test-agent": env.label}, "containers": containers, **spec}}


def _read(env: Env, ns: str, name: str) -> dict[str, Any]:
    return env.api_client.sanitize_for_serialization(env.core.read_namespaced_pod(name, ns))


def _container(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainerStatuses" if init else "containerStatuses"
    return next((c for c in (pod.get("status") or {}).get(key) or [] if c["name"] == name), {})


def _condition(pod: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def _wait_pod(env: Env, ns: str, name: str, done: Any, description: str,
              tier: timeouts.Tier = timeouts.POD_START) -> dict[str, Any]:
    return wait_for(lambda: _read(env, ns, name), done, timeout=tier, interval=0.5,
                    description=f"pod {ns}/{name}: {description}", ignore=(ApiException,))


def _seconds(stamp: Any) -> float:
    """Epoch seconds of an API timestamp (a string, or a datetime after sanitising)."""
    import datetime as dt

    if isinstance(stamp, dt.datetime):
        return stamp.timestamp()
    return dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def _worker(env: Env, ns: str, name: str) -> Any:
    return next(w for w in env.agent.workers() if w.namespace == ns and w.name == name)


def test_nodes_register_ready_with_gpu_capacity_and_leases(env: Env, evidence: Any) -> None:
    print("agent_start_s", evidence.record("agent_start_s", round(env.up_s, 2)))
    nodes = {n.metadata.name: n for n in env.core.list_node(label_selector=f"rayproof.dev/test-agent={env.label}").items}
    assert sorted(nodes) == sorted(env.agent.node_names), sorted(nodes)
    ports = set()
    for name, node in nodes.items():
        cap, alloc = node.status.capacity, node.status.allocatable
        assert cap["nvidia.com/gpu"] == str(GPUS_PER_NODE) and alloc["nvidia.com/gpu"] == str(GPUS_PER_NODE), cap
        assert (cap["cpu"], cap["memory"], cap["pods"]) == ("4", "16Gi", "110"), cap
        ready = {c.type: c.status for c in node.status.conditions}
        assert ready == {"Ready": "True", "MemoryPressure": "False", "DiskPressure": "False",
                         "PIDPressure": "False"}, (name, ready)
        assert not [t for t in node.spec.taints or [] if t.key.startswith("node.kubernetes.io/")], node.spec.taints
        assert {(a.type, a.address) for a in node.status.addresses} == {("InternalIP", "127.0.0.1"),
                                                                          ("Hostname", name)}
        assert node.metadata.labels["kubernetes.io/hostname"] == name
        assert node.status.node_info.kubelet_version.startswith("v1."), node.status.node_info
        ports.add(node.status.daemon_endpoints.kubelet_endpoint.port)
    assert len(ports) == NODES and 0 not in ports, ports
    leases = client.CoordinationV1Api(env.api_client).list_namespaced_lease("kube-node-lease").items
    mine = {le.metadata.name: le for le in leases if le.metadata.name in nodes}
    assert sorted(mine) == sorted(nodes), sorted(mine)
    for le in mine.values():
        assert le.spec.holder_identity == le.metadata.name and le.spec.lease_duration_seconds == 40
    # Heartbeats continue: a lease is renewed within two renew periods.
    first = mine[env.agent.node_names[0]].spec.renew_time
    wait_for(lambda: client.CoordinationV1Api(env.api_client).read_namespaced_lease(
                 env.agent.node_names[0], "kube-node-lease").spec.renew_time,
             lambda t: t > first, timeout=timeouts.NODE_READY, description="the node lease to be renewed")


def test_init_container_env_configmap_volume_and_logs_through_the_api(env: Env, ns: str, evidence: Any) -> None:
    env.core.create_namespaced_config_map(ns, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello-from-cm"}})
    script = ("echo pod=$(POD_NAME) ns=$POD_NS node=$NODE ip=$POD_IP app=$APP mem=$MEM; "
              "echo cm=$(cat /etc/cfg/greeting); echo init=$(cat /work/marker); echo host=$(hostname); "
              "echo tmp=$(ls -A /tmp | wc -l); echo sa=$(ls /var/run/secrets/kubernetes.io/serviceaccount | tr '\\n' ,); "
              "exec sleep 3600")
    pod = _pod(env, "demo", [{
        "name": "main", "image": "rayproject/ray:2.60.0", "command": ["/bin/bash", "-c"], "args": [script],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        ],
        "resources": {"limits": {"memory": "300Mi"}},
        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}, {"name": "work", "mountPath": "/work"}],
    }], initContainers=[{
        "name": "init", "image": "busybox:1.36",
        "command": ["sh", "-c", "echo init-ran > /work/marker; echo init says hi"],
        "volumeMounts": [{"name": "work", "mountPath": "/work"}],
    }], volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "work", "emptyDir": {}}])
    t0 = time.monotonic()
    env.core.create_namespaced_pod(ns, pod)
    p = _wait_pod(env, ns, "demo", lambda p: _condition(p, "Ready") == "True", "Ready")
    print("pod_create_to_ready_s", evidence.record("pod_create_to_ready_s", round(time.monotonic() - t0, 2)))
    init = _container(p, "init", init=True)
    assert init["state"]["terminated"]["exitCode"] == 0 and init["state"]["terminated"]["reason"] == "Completed", init
    assert {c: _condition(p, c) for c in ("PodScheduled", "Initialized", "ContainersReady", "Ready")} == dict.fromkeys(
        ("PodScheduled", "Initialized", "ContainersReady", "Ready"), "True")
    assert p["status"]["phase"] == "Running" and p["status"]["hostIP"] == "127.0.0.1"
    assert p["status"]["podIP"].startswith("198.18."), p["status"]
    node, ip = p["spec"]["nodeName"], p["status"]["podIP"]
    want = [f"pod=demo ns={ns} node={node} ip={ip} app=demo mem=300", "cm=hello-from-cm", "init=init-ran",
            "host=demo", "tmp=0", "sa=ca.crt,namespace,token,"]
    logs = wait_for(lambda: env.core.read_namespaced_pod_log("demo", ns, container="main"),
                    lambda text: all(w in text for w in want), timeout=timeouts.PROCESS_EXIT,
                    description="the main container's log, read through the API server")
    assert logs.splitlines()[: len(want)] == want, logs
    assert env.core.read_namespaced_pod_log("demo", ns, container="init").strip() == "init says hi"
    tail = env.core.read_namespaced_pod_log("demo", ns, container="main", tail_lines=2).splitlines()
    assert tail == want[-2:], tail


def test_logs_follow_streams_until_the_container_exits(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "talker", [{
        "name": "c", "image": "busybox",
        "command": ["sh", "-c", "for i in 1 2 3 4 5 6; do echo line-$i; sleep 0.5; done"]}], restartPolicy="Never"))
    _wait_pod(env, ns, "talker", lambda p: "running" in (_container(p, "c").get("state") or {})
              or p["status"].get("phase") == "Succeeded", "started")
    t0 = time.monotonic()
    resp = env.core.read_namespaced_pod_log("talker", ns, follow=True, _preload_content=False,
                                            _request_timeout=timeouts.PROCESS_EXIT.seconds)
    text = resp.data.decode()  # returns when the node ends the stream: the container exited
    assert text.split() == [f"line-{i}" for i in range(1, 7)], text
    assert time.monotonic() - t0 < timeouts.PROCESS_EXIT.seconds
    p = _wait_pod(env, ns, "talker", lambda p: p["status"].get("phase") == "Succeeded", "Succeeded")
    assert _condition(p, "Ready") == "False"


def test_memory_limit_exceeded_is_oomkilled_137_and_restarted(env: Env, ns: str) -> None:
    hog = ("import time\nprint('hog starting', flush=True)\nb = []\nwhile True:\n    b.append(bytearray(8 << 20))\n"
           "    time.sleep(0.02)\n")  # sleep-ok: the hog container's own allocation pace, not test synchronisation
    env.core.create_namespaced_pod(ns, _pod(env, "hog", [{
        "name": "hog", "image": "python:3.11", "command": ["python3", "-c", hog],
        "resources": {"limits": {"memory": "64Mi"}},
    }]))
    p = _wait_pod(env, ns, "hog", lambda p: _container(p, "hog").get("restartCount", 0) >= 1
                  and (_container(p, "hog").get("lastState") or {}).get("terminated"),
                  "restarted after an OOM kill", timeouts.CONTAINER_TRANSITION)
    term = _container(p, "hog")["lastState"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("OOMKilled", 137), term
    assert p["spec"]["restartPolicy"] == "Always" and p["status"]["phase"] == "Running", p["status"]["phase"]
    assert "hog starting" in env.core.read_namespaced_pod_log("hog", ns, previous=True)
    # It keeps crashing, and the kubelet's back-off shows between restarts.
    p = _wait_pod(env, ns, "hog", lambda p: (_container(p, "hog")["state"].get("waiting") or {}).get("reason")
                  == "CrashLoopBackOff", "CrashLoopBackOff", timeouts.CONTAINER_TRANSITION)
    assert "back-off 10s restarting failed container=hog" in _container(p, "hog")["state"]["waiting"]["message"]


def test_image_outside_the_catalog_fails_to_pull_and_never_becomes_ready(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "bad", [{"name": "c", "image": "registry.invalid/nope:1",
                                                          "command": ["sleep", "100"]}]))
    reasons: set[str] = set()

    def observe() -> dict[str, Any]:
        p = _read(env, ns, "bad")
        c = _container(p, "c")
        assert _condition(p, "Ready") != "True" and not c.get("ready"), f"an unpullable image became Ready: {c}"
        assert "containerID" not in c, f"a container was started from an unpullable image: {c}"
        reasons.add(((c.get("state") or {}).get("waiting") or {}).get("reason", ""))
        return p

    def failed_pulls() -> int:
        evs = env.core.list_namespaced_event(ns, field_selector="involvedObject.name=bad,reason=Failed").items
        return sum(e.count or 1 for e in evs if e.message.startswith("Failed to pull image"))

    # Two pull attempts, ten seconds of back-off apart; observed throughout.
    wait_for(lambda: (observe(), failed_pulls())[1], lambda n: n >= 2 and "ImagePullBackOff" in reasons,
             timeout=timeouts.CONTAINER_TRANSITION, description="two failed pulls with ImagePullBackOff between")
    assert reasons <= {"ErrImagePull", "ImagePullBackOff", "ContainerCreating", ""}, reasons
    assert _read(env, ns, "bad")["status"]["phase"] == "Pending"


def test_missing_command_is_a_start_error_and_fails_a_never_pod(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "nocmd", [{"name": "c", "image": "busybox",
                                                            "command": ["no-such-program-here"]}],
                                            restartPolicy="Never"))
    p = _wait_pod(env, ns, "nocmd", lambda p: p["status"].get("phase") == "Failed", "Failed")
    term = _container(p, "c")["state"]["terminated"]
    assert (term["reason"], term["exitCode"]) == ("StartError", 128), term
    assert "executable file not found" in term.get("message", ""), term


def test_shared_claims_are_seen_from_every_node_and_node_local_claims_only_from_their_node(env: Env, ns: str) -> None:
    """rayproof-shared stands in for a network file system, rayproof-node-local for each node's own disk."""
    from clusters.embedded.nodeagent.provisioner import NODE_LOCAL_CLASS, SHARED_CLASS

    first, second = env.agent.node_names[:2]

    def run(name: str, node: str, claim: str, script: str) -> str:
        env.core.create_namespaced_pod(ns, _pod(env, name, [{
            "name": "c", "image": "busybox", "command": ["sh", "-c", script],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}], nodeName=node, restartPolicy="Never",
            volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]))
        p = _wait_pod(env, ns, name, lambda p: p["status"].get("phase") in ("Succeeded", "Failed"), "finished")
        assert p["status"]["phase"] == "Succeeded", p["status"]
        return env.core.read_namespaced_pod_log(name, ns).strip()

    seen = {}
    for storage_class in (SHARED_CLASS, NODE_LOCAL_CLASS):
        claim = storage_class
        env.core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": claim}, "spec": {
            "accessModes": ["ReadWriteMany"], "storageClassName": storage_class,
            "resources": {"requests": {"storage": "1Gi"}}}})
        wait_for(lambda: env.core.read_namespaced_persistent_volume_claim(claim, ns).status.phase, lambda ph: ph == "Bound",
                 timeout=timeouts.CONTROLLER_RECONCILE, description=f"claim {ns}/{claim} to be Bound")
        read = "cat /data/marker 2>/dev/null || echo absent"
        run(f"{claim}-write", first, claim, f"echo written-on-{first} > /data/marker")
        seen[storage_class] = {"same node": run(f"{claim}-read-1", first, claim, read),
                               "other node": run(f"{claim}-read-2", second, claim, read)}
    assert seen[SHARED_CLASS] == {"same node": f"written-on-{first}", "other node": f"written-on-{first}"}, seen
    assert seen[NODE_LOCAL_CLASS] == {"same node": f"written-on-{first}", "other node": "absent"}, seen


def test_slow_pull_image_waits_in_container_creating(env: Env, ns: str) -> None:
    image = "rayproof.local/slow-pull/3/busybox:1.36"
    env.core.create_namespaced_pod(ns, _pod(env, "slow", [{"name": "c", "image": image,
                                                           "command": ["sleep", "300"]}]))
    p = _wait_pod(env, ns, "slow", lambda p: _condition(p, "Ready") == "True", "Ready after the pull")
    started = _seconds(_container(p, "c")["state"]["running"]["startedAt"])
    assert started - _seconds(p["metadata"]["creationTimestamp"]) >= 2, p["status"]  # 3 s, whole seconds
    evs = env.core.list_namespaced_event(ns, field_selector="involvedObject.name=slow,reason=Pulled").items
    assert any(e.message.startswith(f'Successfully pulled image "{image}" in 3.') for e in evs), \
        [e.message for e in evs]


def test_readiness_exec_probe_gates_ready(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "gated", [{
        "name": "c", "image": "busybox", "command": ["sh", "-c", "sleep 4; touch /tmp/ready; exec sleep 3600"],
        "readinessProbe": {"exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1},
    }]))
    p = _wait_pod(env, ns, "gated", lambda p: "running" in (_container(p, "c").get("state") or {}), "running")
    # Running but not ready until the probe passes (the file appears after 4 s).
    assert _condition(p, "Ready") == "False" and _container(p, "c")["ready"] is False, p["status"]
    p = _wait_pod(env, ns, "gated", lambda p: _condition(p, "Ready") == "True", "Ready once the probe passes")
    assert _container(p, "c")["ready"] is True and _condition(p, "ContainersReady") == "True"
    evs = env.core.list_namespaced_event(ns, field_selector="involvedObject.name=gated,reason=Unhealthy").items
    assert any(e.message.startswith("Readiness probe failed") for e in evs), [e.message for e in evs]


def test_liveness_failure_restarts_the_container(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "live", [{
        "name": "web", "image": "python:3.11", "command": ["python3", "-m", "http.server", "8080"],
        "ports": [{"name": "http", "containerPort": 8080}],
        # Ten failures before a restart: a loaded machine can take seconds to
        # start python's server, and probes before then are refused, not 404.
        "livenessProbe": {"httpGet": {"path": "/missing", "port": "http"}, "periodSeconds": 1,
                          "failureThreshold": 10},
    }]))
    _wait_pod(env, ns, "live", lambda p: _container(p, "web").get("restartCount", 0) >= 1,
                  "restarted by its liveness probe", timeouts.CONTAINER_TRANSITION)
    evs = env.core.list_namespaced_event(ns, field_selector="involvedObject.name=live").items
    msgs = [e.message for e in evs]
    assert "Container web failed liveness probe, will be restarted" in msgs, msgs
    assert any("HTTP probe failed with statuscode: 404" in m for m in msgs), msgs


def test_graceful_deletion_removes_the_pod_and_every_trace(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "polite", [{
        "name": "c", "image": "bash", "command": ["bash", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"]}],
        terminationGracePeriodSeconds=30))
    env.core.create_namespaced_pod(ns, _pod(env, "stubborn", [{
        "name": "c", "image": "bash", "command": ["bash", "-c", "trap '' TERM; while :; do sleep 0.2; done"]}],
        terminationGracePeriodSeconds=3))
    traces = {}
    for name in ("polite", "stubborn"):
        _wait_pod(env, ns, name, lambda p: _condition(p, "Ready") == "True", "Ready")
        w = _worker(env, ns, name)
        inst = w.app_states[0].instance
        traces[name] = (inst.pid, str(inst.cgroup.path), w.netns, w.dir)
        assert st.alive(inst.pid) and Path(traces[name][1]).is_dir() and Path(f"/run/netns/{w.netns}").exists()
    took = {}
    for name in ("polite", "stubborn"):
        t0 = time.monotonic()
        env.core.delete_namespaced_pod(name, ns)
        wait_for(lambda: _gone(lambda: env.core.read_namespaced_pod(name, ns)), timeout=timeouts.OBJECT_DELETE,
                 description=f"pod {name} to disappear from the API")
        took[name] = time.monotonic() - t0
        pid, cgroup, netns, pod_dir = traces[name]
        assert not st.alive(pid), f"{name}: main process {pid} still alive"
        assert not Path(cgroup).exists(), f"{name}: cgroup {cgroup} left"
        assert not Path(f"/run/netns/{netns}").exists(), f"{name}: netns {netns} left"
        assert not pod_dir.exists(), f"{name}: pod dir {pod_dir} left"
    assert took["polite"] < 3, took  # exited on SIGTERM at once
    assert 3 <= took["stubborn"] < 3 + timeouts.PROCESS_EXIT.seconds, took  # SIGKILL after its grace period


def test_force_deleted_pod_is_cleaned_up(env: Env, ns: str) -> None:
    env.core.create_namespaced_pod(ns, _pod(env, "forced", [{
        "name": "c", "image": "bash", "command": ["bash", "-c", "trap '' TERM; while :; do sleep 0.2; done"]}],
        terminationGracePeriodSeconds=120))
    _wait_pod(env, ns, "forced", lambda p: _condition(p, "Ready") == "True", "Ready")
    w = _worker(env, ns, "forced")
    pid, cgroup = w.app_states[0].instance.pid, w.app_states[0].instance.cgroup.path
    env.core.delete_namespaced_pod("forced", ns, grace_period_seconds=0)
    wait_for(lambda: (st.alive(pid), cgroup.exists(), w.dir.exists()), lambda t: t == (False, False, False),
             timeout=timeouts.PROCESS_EXIT, description="the force-deleted pod's process, cgroup and dir to go")


def _agent_traces(state_dir: Path) -> dict[str, Any]:
    """What an agent recorded under ``state_dir`` that still exists on the host."""
    parent = st.cgroup_parent_name(state_dir)
    records = st.container_records(state_dir)
    pods = st.pod_records(state_dir)
    return {
        "processes": st.processes_left(records),
        "cgroups": [str(r / parent) for r in (V1_ROOT, V2_ROOT) if (r / parent).exists()],
        "netns": [p.netns for p in pods if p.netns and Path(f"/run/netns/{p.netns}").exists()],
        "pod_dirs": sorted(str(d) for d in (state_dir / "pods").glob("*")) if (state_dir / "pods").exists() else [],
        "mounts": [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if str(state_dir) in line.split()[4]],
    }


def test_agent_stop_leaves_nothing_behind(env: Env, tmp_path: Path) -> None:
    """A second agent (one node) runs a pod with a memory-backed emptyDir, then stops: nothing it made remains."""
    tag = uuid.uuid4().hex[:6]
    agent = NodeAgent(env.platform.kubeconfig, None, tmp_path / "agent", env.podnet, nodes=1,
                      name_prefix=f"na{tag}-solo", labels={"rayproof.dev/test-agent": f"solo-{tag}"})
    agent.start()
    ns = f"na-{tag}"
    env.core.create_namespace({"metadata": {"name": ns}})
    try:
        pod = _pod(env, "solo", [{"name": "c", "image": "busybox", "command": ["sh", "-c", "sleep 3000 & sleep 3001"],
                                  "volumeMounts": [{"name": "m", "mountPath": "/scratch"}]}],
                   volumes=[{"name": "m", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}}])
        pod["spec"]["nodeSelector"] = {"rayproof.dev/test-agent": f"solo-{tag}"}
        wait_for(lambda: env.core.create_namespaced_pod(ns, pod), timeout=timeouts.CONTROLLER_RECONCILE,
                 description="pod creation (the namespace's service account may lag)", ignore=(ApiException,))
        _wait_pod(env, ns, "solo", lambda p: _condition(p, "Ready") == "True", "Ready")
        # Ready means the container started; its shell forks the two sleeps just after.
        wait_for(lambda: _agent_traces(tmp_path / "agent"),
                 lambda t: len(t["processes"]) >= 3 and t["cgroups"] and t["netns"] and t["mounts"],
                 timeout=timeouts.CONTAINER_TRANSITION,
                 description="the pod's shell and both sleeps running, with its cgroup, netns and mount")
        agent.stop()
        after = _agent_traces(tmp_path / "agent")
        assert after == {"processes": [], "cgroups": [], "netns": [], "pod_dirs": [], "mounts": []}, after
        assert sorted(p.name for p in (tmp_path / "agent").iterdir()) == [], list((tmp_path / "agent").iterdir())
        assert agent.stop() == []  # safe to repeat
    finally:
        agent.stop(delete_nodes=True)
        _force_delete_namespace(env, ns)


def test_down_after_a_killed_agent_process_removes_everything(env: Env, tmp_path: Path) -> None:
    """``python -m clusters.embedded.nodeagent`` SIGKILLed with a pod running; ``down`` cleans up from the records."""
    tag = uuid.uuid4().hex[:6]
    state_dir = tmp_path / "agent"
    netdir = env.podnet.state_dir
    cmd = [sys.executable, "-m", "clusters.embedded.nodeagent", "run", "--kubeconfig", str(env.platform.kubeconfig),
           "--state-dir", str(state_dir), "--nodes", "1", "--name-prefix", f"na{tag}-proc",
           "--pod-network-dir", str(netdir), "--platform", env.podnet.platform]
    log = open(tmp_path / "agent.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    node = f"na{tag}-proc-1"
    ns = f"na-{tag}"
    try:
        wait_for(lambda: env.core.read_node(node).spec.taints, lambda taints: not taints,
                 timeout=timeouts.NODE_READY, description=f"node {node} of the agent process to be schedulable",
                 ignore=(ApiException,))
        env.core.create_namespace({"metadata": {"name": ns}})
        pod = _pod(env, "victim", [{"name": "c", "image": "busybox", "command": ["sh", "-c", "sleep 3000 & wait"]}])
        pod["spec"] = {"nodeName": node, "containers": pod["spec"]["containers"]}
        wait_for(lambda: env.core.create_namespaced_pod(ns, pod), timeout=timeouts.CONTROLLER_RECONCILE,
                 description="pod creation", ignore=(ApiException,))
        _wait_pod(env, ns, "victim", lambda p: _condition(p, "Ready") == "True", "Ready")
        assert _agent_traces(state_dir)["processes"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _agent_traces(state_dir)["processes"], "containers must outlive a SIGKILLed agent, as with a kubelet"
        down = subprocess.run([sys.executable, "-m", "clusters.embedded.nodeagent", "down", "--state-dir",
                               str(state_dir), "--pod-network-dir", str(netdir), "--platform", env.podnet.platform],
                              cwd=REPO, capture_output=True, text=True, timeout=timeouts.PROCESS_EXIT.seconds * 2)
        assert down.returncode == 0, down.stderr[-2000:]
        after = _agent_traces(state_dir)
        assert after == {"processes": [], "cgroups": [], "netns": [], "pod_dirs": [], "mounts": []}, after
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        st.cleanup(state_dir)
        _force_delete_namespace(env, ns)
        try:
            env.core.delete_node(node)
        except ApiException:
            pass


def _force_delete_namespace(env: Env, ns: str) -> None:
    """Delete a namespace whose pods sat on a node whose agent is gone: no
    kubelet will finish their graceful deletion, so force it (as an operator would)."""
    try:
        for pod in env.core.list_namespaced_pod(ns).items:
            env.core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
        env.core.delete_namespace(ns)
    except ApiException as exc:
        if exc.status != 404:
            raise
