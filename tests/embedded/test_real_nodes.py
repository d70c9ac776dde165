"""The real node layer (profile ``nodes.runtime: kubelet``): upstream kubelet, containerd and runc.

One platform of two real nodes for the module (its own name and run
directory, so it never meets the session's platform), brought up under a host
slot. What is checked is what the node agent can only imitate: the container
runtime's answers reaching the API through kubelet (an OOM kill's 137 and
``lastState``, images pulled from the platform's registry and a pull's
failure and back-off), kubelet's own server
(``logs``, ``exec``), pods of two nodes talking across the router through a
Service (kube-proxy's rules in the node) and cluster DNS, a NetworkPolicy
dropping that traffic, and a
``down`` that leaves nothing on the machine.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client

from clusters.embedded import build
from clusters.embedded.controlplane import Supervisor
from clusters.embedded.nodes import node as node_mod
from clusters.embedded.nodes.fabric import NodeNet
from clusters.embedded.nodes.images import busybox_version
from clusters.embedded.platform import EmbeddedPlatform
from clusters.embedded.podnet import _host
from fixtures.sharing import host_slot
from rayproof import timeouts
from rayproof.waiting import wait_for

# One xdist worker takes the whole module, so its platform of real nodes is brought up once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-nodes")]

REPO = Path(__file__).resolve().parents[2]
RUN = secrets.token_hex(3)
LABELS = {"rayproof.io/run": RUN}
NODES = 2


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPlatform]:
    build.ensure_built(progress=print)
    name = f"kubelet-{os.getpid()}"
    p = EmbeddedPlatform(name, run_dir=tmp_path_factory.mktemp("kubelet") / "platform",
                         profile={"nodes": {"runtime": "kubelet", "count": NODES}})
    with host_slot():
        try:
            yield p.up()
        finally:
            p.down()


@pytest.fixture(scope="module")
def core(platform: EmbeddedPlatform) -> client.CoreV1Api:
    return client.CoreV1Api(platform.api_client())


@pytest.fixture(scope="module")
def namespace(core: client.CoreV1Api) -> Iterator[str]:
    name = f"rayproof-nodes-{RUN}"
    core.create_namespace({"metadata": {"name": name, "labels": LABELS}})
    yield name
    core.delete_namespace(name)


def kubectl(platform: EmbeddedPlatform, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(platform.binaries()["kubectl"]), f"--kubeconfig={platform.kubeconfig}", *args],
                          capture_output=True, text=True, timeout=120, check=check)


def shell_pod(name: str, script: str, *, node: int | None = None, memory: str = "32Mi",
              image: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": image or f"busybox:{busybox_version()}",
                        "command": ["sh", "-c", script],
                        "resources": {"limits": {"memory": memory, "cpu": "100m"}}}],
    }
    if node is not None:
        spec["nodeName"] = f"rayproof-node-{node}"
    return {"metadata": {"name": name, "labels": {**LABELS, **(labels or {})}}, "spec": spec}


def container_status(core: client.CoreV1Api, namespace: str, name: str) -> Any:
    statuses = core.read_namespaced_pod(name, namespace).status.container_statuses or []
    return statuses[0] if statuses else None


def test_nodes_are_kubelets_on_containerd(platform: EmbeddedPlatform, core: client.CoreV1Api) -> None:
    nodes = core.list_node().items
    info = {n.metadata.name: (n.status.node_info.kubelet_version, n.status.node_info.container_runtime_version,
                              n.status.node_info.operating_system) for n in nodes}
    versions = {**build.pinned_versions(), **build.node_versions()}
    assert sorted(info) == [f"rayproof-node-{i}" for i in range(1, NODES + 1)], info
    assert set(info.values()) == {(versions["kubernetes"], f"containerd://{versions['containerd'].lstrip('v')}",
                                   "linux")}, info
    wide = kubectl(platform, "get", "nodes", "-o", "wide").stdout
    assert "containerd://" in wide and versions["kubernetes"] in wide, wide


def test_a_node_pulls_its_images_from_the_platforms_registry(core: client.CoreV1Api, namespace: str) -> None:
    """The first pod on a node: kubelet pulls the shell image (and the sandbox image) from the registry."""
    core.create_namespaced_pod(namespace, shell_pod("first", "sleep 3600", node=NODES))
    wait_for(lambda: core.read_namespaced_pod("first", namespace).status.phase, lambda phase: phase == "Running",
             timeout=timeouts.POD_START, description="pod first Running")
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=first").items
    pulled = [e.message for e in events if e.reason == "Pulled" and "Successfully pulled" in e.message]
    assert pulled and f"busybox:{busybox_version()}" in pulled[0], [(e.reason, e.message) for e in events]

    def node_images() -> set[str]:
        node = core.read_node(f"rayproof-node-{NODES}")
        return {n for image in node.status.images or [] for n in image.names}
    wait_for(node_images, lambda names: "registry.k8s.io/pause:3.10.1" in names,
             timeout=timeouts.CONTAINER_TRANSITION, description="the node's status to list the sandbox image it pulled")


def test_gpus_are_a_device_plugins_and_each_container_gets_distinct_ones(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """kubelet advertises what the fake GPU plugin registered, and allocates each container its own ids."""
    want = platform.profile.node_shape["nvidia.com/gpu"]
    capacity = {n.metadata.name: n.status.capacity.get("nvidia.com/gpu") for n in core.list_node().items}
    assert set(capacity.values()) == {want}, capacity
    for name in ("gpu-a", "gpu-b"):
        pod = shell_pod(name, 'echo "devices=$NVIDIA_VISIBLE_DEVICES"; sleep 3600', node=1)
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "3"
        core.create_namespaced_pod(namespace, pod)
    seen = {}
    for name in ("gpu-a", "gpu-b"):
        line = wait_for(lambda n=name: core.read_namespaced_pod_log(n, namespace), lambda text: "devices=" in text,
                        timeout=timeouts.POD_START, ignore=(client.ApiException,),
                        description=f"pod {name} to print the GPUs it was given")
        seen[name] = set(line.split("devices=", 1)[1].split()[0].split(","))
    assert all(len(ids) == 3 for ids in seen.values()), seen
    assert not seen["gpu-a"] & seen["gpu-b"], seen
    assert all(i.startswith("rayproof-node-1-gpu-") for ids in seen.values() for i in ids), seen


def test_a_container_over_its_memory_limit_is_oom_killed_by_the_kernel(
        core: client.CoreV1Api, namespace: str) -> None:
    """The kernel kills it (exit 137); kubelet reports OOMKilled, restarts it and keeps lastState."""
    # dd's one 64 MiB block is a 64 MiB buffer, filled: twice the limit. It is the container's
    # main process (exec): were it a child of the shell, the kernel would kill only the child.
    core.create_namespaced_pod(namespace, shell_pod("oom", "exec dd if=/dev/zero of=/dev/null bs=64M count=1"))
    status = wait_for(lambda: container_status(core, namespace, "oom"),
                      lambda s: s is not None and (s.restart_count or 0) >= 1 and s.last_state.terminated is not None,
                      timeout=timeouts.CONTAINER_TRANSITION, description="pod oom restarted after an OOM kill")
    terminated = status.last_state.terminated
    assert (terminated.reason, terminated.exit_code) == ("OOMKilled", 137), terminated


def test_an_image_the_registry_does_not_hold_fails_to_pull_then_backs_off(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, shell_pod("nopull", "true", image="rayproof.invalid/none/such:1"))
    seen: set[str] = set()

    def reason() -> str | None:
        s = container_status(core, namespace, "nopull")
        why = s.state.waiting.reason if s is not None and s.state.waiting is not None else None
        if why:
            seen.add(why)
        return why

    wait_for(reason, lambda _: {"ErrImagePull", "ImagePullBackOff"} <= seen, timeout=timeouts.CONTAINER_TRANSITION,
             description="pod nopull to show ErrImagePull, then ImagePullBackOff")
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=nopull").items
    # The registry's own answer, through containerd and kubelet: the repository is not there.
    assert any(e.source.component == "kubelet" and e.reason == "Failed" and "not found" in e.message
               for e in events), [(e.source.component, e.reason, e.message) for e in events]


def test_logs_and_exec_are_served_by_kubelet(platform: EmbeddedPlatform, core: client.CoreV1Api,
                                            namespace: str) -> None:
    """The API server reaches kubelet's server through the router: logs and exec work as on any cluster."""
    core.create_namespaced_pod(namespace, shell_pod("talk", "echo hello-from-$(hostname); sleep 3600"))
    wait_for(lambda: core.read_namespaced_pod("talk", namespace).status.phase, lambda phase: phase == "Running",
             timeout=timeouts.POD_START, description="pod talk Running")
    logs = wait_for(lambda: kubectl(platform, "-n", namespace, "logs", "talk", check=False),
                    lambda r: "hello-from-talk" in r.stdout, timeout=timeouts.CONTAINER_TRANSITION,
                    description="kubectl logs talk to show its greeting")
    assert logs.returncode == 0
    ran = kubectl(platform, "-n", namespace, "exec", "talk", "--", "sh", "-c", "echo $$; cat /proc/1/cmdline")
    pid, cmdline = ran.stdout.split("\n", 1)
    # The container's own PID namespace: its PID 1 is the container's command (sh exec'd its last one).
    assert pid.strip() != "1" and cmdline.startswith("sleep\x003600"), ran.stdout


def test_pods_on_two_nodes_and_on_one_talk_through_a_service_by_name_until_a_policy_denies_it(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_pod(namespace, shell_pod(
        "server", "mkdir -p /www && echo served-by-$(hostname) > /www/index.html && httpd -f -p 8080 -h /www",
        node=1, labels={"app": "server"}))
    core.create_namespaced_service(namespace, {"metadata": {"name": "web", "labels": LABELS}, "spec": {
        "selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    core.create_namespaced_pod(namespace, shell_pod("client", "sleep 3600", node=NODES))
    core.create_namespaced_pod(namespace, shell_pod("neighbour", "sleep 3600", node=1))  # the server's node
    for name in ("server", "client", "neighbour"):
        wait_for(lambda n=name: core.read_namespaced_pod(n, namespace).status.phase, lambda ph: ph == "Running",
                 timeout=timeouts.POD_START, description=f"pod {name} Running")
    # busybox's nc, not its wget: Debian's static busybox wget crashes (SIGSEGV) in glibc's resolver.
    def fetch(pod: str) -> subprocess.CompletedProcess[str]:
        return kubectl(platform, "-n", namespace, "exec", pod, "--", "sh", "-c",
                       f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 web.{namespace}.svc 80", check=False)

    for pod in ("client", "neighbour"):
        got = wait_for(lambda p=pod: fetch(p), lambda r: "served-by-server" in r.stdout,
                       timeout=timeouts.CONTAINER_TRANSITION, description=f"{pod} to fetch from server through Service web")
        assert got.returncode == 0
    # kube-proxy of the client's node holds the Service's rules: the DNAT happens before the packet leaves it.
    cluster_ip = core.read_namespaced_service("web", namespace).spec.cluster_ip
    nat = _host.iptables_save(NodeNet(platform.name, NODES).netns, "nat")
    assert f"-d {cluster_ip}/32" in nat and "KUBE-SVC-" in nat, nat
    client.NetworkingV1Api(platform.api_client()).create_namespaced_network_policy(namespace, {
        "metadata": {"name": "deny-ingress", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"]}})
    # The same-node neighbour too: its packets leave the node for the router, where policy is judged.
    for pod in ("client", "neighbour"):
        blocked = wait_for(lambda p=pod: fetch(p), lambda r: r.returncode != 0, timeout=timeouts.CONTROLLER_RECONCILE,
                           description=f"the deny-ingress policy to cut {pod} off")
        assert "served-by-server" not in blocked.stdout


def test_down_leaves_no_process_namespace_cgroup_or_host_path(tmp_path: Path) -> None:
    """A second platform of one node: after down, nothing of it is left on the machine."""
    name = f"kubelet-down-{os.getpid()}"
    run_dir = tmp_path / "platform"
    p = EmbeddedPlatform(name, run_dir=run_dir, profile={"nodes": {"runtime": "kubelet", "count": 1}})
    node = node_mod.cgroup_root(name, "rayproof-node-1")
    before = set(node_mod.host_leaks())
    with host_slot():
        try:
            p.up()
            core = client.CoreV1Api(p.api_client())
            core.create_namespaced_pod("default", shell_pod("sleeper", "sleep 3600"))
            wait_for(lambda: core.read_namespaced_pod("sleeper", "default").status.phase,
                     lambda phase: phase == "Running", timeout=timeouts.POD_START, description="pod sleeper Running")
            assert node_mod._tree_pids(node_mod.v1_hierarchies()[0] / node.lstrip("/")), "nothing ran in the node"
        finally:
            p.down()
    assert not run_dir.exists()
    assert not [h for h in node_mod.v1_hierarchies(with_unified=True) if (h / node.lstrip("/")).exists()]
    assert not _host.list_netns(f"rayproof-{name}-"), _host.list_netns(f"rayproof-{name}-")
    assert not _host.netns_exists(NodeNet(name, 1).netns)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(run_dir) not in mounts, [line for line in mounts.splitlines() if str(run_dir) in line]
    assert set(node_mod.host_leaks()) <= before, node_mod.host_leaks()


def test_down_after_up_was_killed_with_nodes_running(tmp_path: Path) -> None:
    """SIGKILL of the process running up() once a kubelet runs: down() from another process still
    stops containerd, kubelet and what they started, and removes the nodes' namespaces and cgroups."""
    name = f"kubelet-kill-{os.getpid()}"
    run_dir = tmp_path / "platform"
    profile = tmp_path / "profile.yaml"
    profile.write_text("nodes:\n  runtime: kubelet\n  count: 1\n")
    sup = Supervisor(run_dir)
    before = set(node_mod.host_leaks())
    with host_slot():
        starter = subprocess.Popen(
            [sys.executable, "-m", "clusters.embedded.platform", "up", "--name", name, "--run-dir", str(run_dir),
             "--profile", str(profile)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        p = EmbeddedPlatform(name, run_dir=run_dir, profile=profile)
        try:
            wait_for(lambda: sup.running("kubelet-1"), timeout=timeouts.CONTROL_PLANE_START,
                     description="the starter to have started the node's kubelet")
            os.kill(starter.pid, signal.SIGKILL)
            starter.wait()
            records = sup.records()
            done = p.down()
        finally:
            if starter.poll() is None:
                os.kill(starter.pid, signal.SIGKILL)
                starter.wait()
            p.down()
    alive = [f"{r.name} (PID {r.pid})" for r in records if r.identity_ok()]
    assert not alive, f"still running after down(): {alive}; down() said {done}"
    assert not run_dir.exists(), done
    cgroup = node_mod.cgroup_root(name, "rayproof-node-1").lstrip("/")
    assert not [h for h in node_mod.v1_hierarchies(with_unified=True) if (h / cgroup).exists()]
    assert not _host.list_netns(f"rayproof-{name}-"), _host.list_netns(f"rayproof-{name}-")
    assert set(node_mod.host_leaks()) <= before, node_mod.host_leaks()
