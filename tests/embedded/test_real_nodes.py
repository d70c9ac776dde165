"""The real node layer (profile ``nodes.runtime: kubelet``): upstream kubelet, containerd and runc.

One platform of two real nodes for the module (its own name and run
directory, so it never meets the session's platform), brought up under a host
slot. What is checked is what the retired node agent could only imitate: the
container runtime's answers reaching the API through kubelet (an OOM kill's 137 and
``lastState``, images pulled from the platform's registry, a pull's failure
and back-off, a slow pull through the registry's slow path), kubelet's own
server (``logs``, ``exec``, ``port-forward``), its probes and graceful
deletion (the preStop hook, then SIGTERM), pods of two nodes talking across
the router through a Service (kube-proxy's rules in the node) and cluster
DNS, a NetworkPolicy dropping that traffic, holding from a new pod's first
packet and stalling a connection opened before it, cluster DNS served by
CoreDNS pods and cut by a pod's egress policy, volumes shared by every
node or each node's own, the Redis and Ray images the platform builds (the
pinned Ray and torch inside; the Ray image pre-pulled onto every node at
``up``, its unpacked files then held once on the machine), KubeRay's own
samples running on the nodes (one admitted through a team's LocalQueue);
and, each on a platform of one node of its own, kubelet's eviction of the
pod furthest over its requests when the node runs short of memory, and a
``down`` that leaves nothing on the machine.
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client

from chaos import straggler
from clusters.embedded import build
from clusters.embedded.controlplane import Supervisor
from clusters.embedded.nodes import node as node_mod
from clusters.embedded.nodes import rayimage
from clusters.embedded.nodes.fabric import NodeNet
from clusters.embedded.nodes.images import COREDNS_IMAGE, busybox_version
from clusters.embedded.pki import FIRST_SERVICE_IP
from clusters.embedded.platform import EmbeddedPlatform
from clusters.embedded.podnet import DNS_IP, ROUTER_IP, _host
from core import profile as profile_mod
from core import timeouts
from core.waiting import wait_for
from fixtures import janitor
from fixtures.sharing import host_slot

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
    p.wait_for_room()  # before the slot, which would stand idle meanwhile
    with host_slot():
        try:
            yield p.up(wait_for_room=True)
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


@pytest.fixture(autouse=True)
def pods_removed_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test's pods in the module's namespace go when it ends. A node here offers the machine's two
    CPUs, and the sleeping pods of earlier tests held enough of them (beside CoreDNS) that a KubeRay
    sample's submitter stayed Pending for Insufficient cpu."""
    used = ((request.getfixturevalue("core"), request.getfixturevalue("namespace"))
            if "namespace" in request.fixturenames else None)
    yield
    if used is not None:
        core, namespace = used
        core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)


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


def test_a_container_whose_child_is_oom_killed_ends_oom_killed_as_a_whole(
        core: client.CoreV1Api, namespace: str) -> None:
    """cgroup v2's memory.oom.group on cgroup v1 (``oomgroup.py``): once the kernel kills dd, a child of
    the container's shell, the shell goes too, so the container ends OOMKilled, 137, and restarts. Without
    the group the shell would sleep on for the hour, Running.

    dd starts at once, in four containers at a time. Its pod's cgroup, at the same limit, is often the one
    at its limit: cgroup v1 then reports the OOM for the pause container too, and killing it took the
    pod's sandbox (a container once ended StartError, "sandbox container ... is not running"); the group
    kills only the container whose cgroup counted the kernel's kill."""
    names = [f"oom-child-{i}" for i in range(4)]
    for i, name in enumerate(names):
        core.create_namespaced_pod(namespace, shell_pod(
            name, "dd if=/dev/zero of=/dev/null bs=64M count=1; echo the shell lives on; exec sleep 3600",
            node=i % NODES + 1))

    def ends() -> dict[str, Any]:
        return {name: (s.last_state.terminated if s is not None and (s.restart_count or 0) >= 1 else None)
                for name, s in ((n, container_status(core, namespace, n)) for n in names)}

    ended = wait_for(ends, lambda e: all(t is not None for t in e.values()), timeout=timeouts.CONTAINER_TRANSITION,
                     description="pods oom-child-0..3 restarted after the kernel OOM-killed each shell's child")
    assert {name: (t.reason, t.exit_code) for name, t in ended.items()} == dict.fromkeys(names, ("OOMKilled", 137)), \
        {name: (t.reason, t.exit_code, t.message) for name, t in ended.items()}


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


def test_a_slow_name_is_a_real_pull_through_the_registrys_slow_path(core: client.CoreV1Api, namespace: str) -> None:
    """ADM-3's straggler image (the profile's kueue.slowPullImage): kubelet pulls it for its seconds, every
    name anew (two init containers on one node, each a new name, each pulled as slowly), and its default
    command exits 0."""
    template = profile_mod.load()["kueue"]["slowPullImage"]  # platform-owned-ok: the reference platform's, read
    seconds = 6
    pod = shell_pod("slow", "true", node=1)
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["initContainers"] = [straggler.slow_pull_container("unused", seconds, template) for _ in range(2)]
    for i, init in enumerate(pod["spec"]["initContainers"]):
        init["name"] = f"slow-{i}"
    images = [c["image"] for c in pod["spec"]["initContainers"]]
    created = time.monotonic()
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: core.read_namespaced_pod("slow", namespace).status.phase, lambda phase: phase == "Succeeded",
             timeout=timeouts.POD_START, description="pod slow to pull its two slow images and finish")
    took = time.monotonic() - created
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=slow").items
    pulled = {image: straggler.pull_seconds(e.message) for e in events if e.reason == "Pulled"
              for image in images if f'"{image}"' in e.message}
    assert set(pulled) == set(images) and all(s is not None and s >= seconds - 0.5 for s in pulled.values()), (
        f"kubelet's pulls of {images}: {[(e.reason, e.message) for e in events]}")
    assert took >= 2 * seconds, f"the pod finished {took:.1f} s after its creation, before two {seconds} s pulls"
    inits = core.read_namespaced_pod("slow", namespace).status.init_container_statuses
    assert [(s.state.terminated.exit_code if s.state.terminated else None) for s in inits] == [0, 0], inits


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


def test_port_forward_is_served_by_kubelet(platform: EmbeddedPlatform, core: client.CoreV1Api,
                                          namespace: str) -> None:
    """kubectl port-forward on this machine reaches a port of the pod's own network namespace, through
    the API server and kubelet's (containerd's) streaming server, as on any cluster."""
    from clusters.embedded.controlplane import free_ports

    token = secrets.token_hex(6)
    core.create_namespaced_pod(namespace, shell_pod(
        "served", f"mkdir -p /www && echo served-{token} > /www/index.html && exec httpd -f -p 8080 -h /www"))
    wait_for(lambda: core.read_namespaced_pod("served", namespace).status.phase, lambda phase: phase == "Running",
             timeout=timeouts.POD_START, description="pod served Running")
    port, = free_ports(1)
    forward = subprocess.Popen([str(platform.binaries()["kubectl"]), f"--kubeconfig={platform.kubeconfig}",
                                "-n", namespace, "port-forward", "pod/served", f"{port}:8080", "--address", "127.0.0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def fetch() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
                return resp.read().decode()
        body = wait_for(fetch, lambda text: f"served-{token}" in text, timeout=timeouts.CONTAINER_TRANSITION,
                        ignore=(OSError,), description=f"the pod's page through kubectl port-forward on port {port}")
        assert body.strip() == f"served-{token}"
    finally:
        forward.terminate()
        out, _ = forward.communicate(timeout=30)
    assert f"Forwarding from 127.0.0.1:{port} -> 8080" in out, out


def test_readiness_and_liveness_probes_are_kubelets(platform: EmbeddedPlatform, core: client.CoreV1Api,
                                                   namespace: str) -> None:
    """A readiness probe gates Ready; a failing liveness probe has kubelet kill and restart the container,
    whose new writable layer no longer holds what made it Ready."""
    pod = shell_pod("probed", "sleep 3600")
    pod["spec"]["containers"][0].update(
        readinessProbe={"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1},
        livenessProbe={"exec": {"command": ["test", "!", "-f", "/tmp/sick"]}, "periodSeconds": 1,
                       "failureThreshold": 1})
    core.create_namespaced_pod(namespace, pod)

    def state() -> tuple[str | None, bool, int]:
        s = container_status(core, namespace, "probed")
        if s is None:
            return None, False, 0
        current = "running" if s.state.running else "waiting" if s.state.waiting else "terminated"
        return current, bool(s.ready), s.restart_count or 0

    assert wait_for(state, lambda st: st[0] == "running", timeout=timeouts.POD_START,
                    description="pod probed's container running")[1] is False  # no /tmp/ready yet
    kubectl(platform, "-n", namespace, "exec", "probed", "--", "touch", "/tmp/ready")
    wait_for(state, lambda st: st[1], timeout=timeouts.CONTAINER_TRANSITION,
             description="the readiness probe to find /tmp/ready and the container Ready")
    kubectl(platform, "-n", namespace, "exec", "probed", "--", "touch", "/tmp/sick")
    restarted = wait_for(state, lambda st: st[2] >= 1 and st[0] == "running", timeout=timeouts.CONTAINER_TRANSITION,
                         description="kubelet to restart the container its liveness probe found sick")
    assert restarted[1] is False, "the restarted container is Ready: its writable layer kept /tmp/ready"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=probed").items
    assert any(e.source.component == "kubelet" and e.reason == "Unhealthy" and "Liveness probe failed" in e.message
               for e in events), [(e.source.component, e.reason, e.message) for e in events]


def test_deletion_runs_the_prestop_hook_then_sigterm_within_the_grace_period(
        core: client.CoreV1Api, namespace: str) -> None:
    """Graceful deletion as kubelet does it: the preStop hook runs to its end, then the container's
    process gets SIGTERM, well within terminationGracePeriodSeconds (written to a claim that outlives it)."""
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "journal", "labels": LABELS},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    volume = {"volumes": [{"name": "journal", "persistentVolumeClaim": {"claimName": "journal"}}]}
    mount = {"volumeMounts": [{"name": "journal", "mountPath": "/journal"}]}
    # The shell is the container's PID 1: it handles SIGTERM by its trap (exec'd sleeps would not).
    pod = shell_pod("graceful", "trap 'echo sigterm >> /journal/log; exit 0' TERM; echo started >> /journal/log; "
                                "while true; do sleep 1; done", node=1)
    pod["spec"].update(terminationGracePeriodSeconds=30, **volume)
    pod["spec"]["containers"][0].update(lifecycle={"preStop": {"exec": {"command": [
        "sh", "-c", "echo prestop-begun >> /journal/log; sleep 3; echo prestop-ended >> /journal/log"]}}}, **mount)
    core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: core.read_namespaced_pod("graceful", namespace).status.phase, lambda ph: ph == "Running",
             timeout=timeouts.POD_START, description="pod graceful Running")
    began = time.monotonic()
    core.delete_namespaced_pod("graceful", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("graceful", namespace)
        except client.ApiException as exc:
            return exc.status == 404
        return False
    wait_for(gone, bool, timeout=timeouts.CONTAINER_TRANSITION, description="pod graceful deleted")
    took = time.monotonic() - began
    reader = shell_pod("journal-reader", "cat /journal/log", node=NODES)
    reader["spec"].update(restartPolicy="Never", **volume)
    reader["spec"]["containers"][0].update(**mount)
    core.create_namespaced_pod(namespace, reader)
    wait_for(lambda: core.read_namespaced_pod("journal-reader", namespace).status.phase, lambda ph: ph == "Succeeded",
             timeout=timeouts.POD_START, description="pod journal-reader to read the journal")
    journal = core.read_namespaced_pod_log("journal-reader", namespace).split()
    assert journal == ["started", "prestop-begun", "prestop-ended", "sigterm"], journal
    assert 3 <= took < 30, f"the pod took {took:.1f} s to go: the 3 s preStop hook, then SIGTERM, within the 30 s grace"


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
    # kube-proxy of the client's node holds the Service's rules: the DNAT happens before the packet leaves
    # it. Nothing stands in for it: the router between the nodes holds no Service rule (podnet has none).
    cluster_ip = core.read_namespaced_service("web", namespace).spec.cluster_ip
    wait_for(lambda: _host.iptables_save(NodeNet(platform.name, NODES).netns, "nat"),
             lambda nat: f"-d {cluster_ip}/32" in nat and "KUBE-SVC-" in nat, timeout=timeouts.CONTAINER_TRANSITION,
             description=f"kube-proxy of node {NODES} to hold Service web's DNAT rule for {cluster_ip}: its nat table")
    router_nat = _host.iptables_save(f"rayproof-{platform.name}-net", "nat")
    assert cluster_ip not in router_nat and "DNAT" not in router_nat, router_nat
    client.NetworkingV1Api(platform.api_client()).create_namespaced_network_policy(namespace, {
        "metadata": {"name": "deny-ingress", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"]}})
    # The same-node neighbour too: its packets leave the node for the router and come back in, where
    # kube-router of the server's node judges them.
    for pod in ("client", "neighbour"):
        blocked = wait_for(lambda p=pod: fetch(p), lambda r: r.returncode != 0, timeout=timeouts.CONTROLLER_RECONCILE,
                           description=f"the deny-ingress policy to cut {pod} off")
        assert "served-by-server" not in blocked.stdout
    # kube-router's chains in the server's node judge it.
    node_rules = _host.iptables_save(NodeNet(platform.name, 1).netns, "filter")
    assert "-j KUBE-ROUTER-FORWARD" in node_rules and "KUBE-POD-FW-" in node_rules, node_rules


def test_a_new_policy_stalls_a_connection_opened_before_it_until_it_is_lifted(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """The reference platform cuts open connections (``network.policyCutsOpenConnections: true``), as
    NET-4's self-test needs: kube-router alone keeps what conntrack knows, so the router's engine
    judges every packet a connection's initiator sends. A client on another node streams a tick a
    second to a server; a deny-ingress policy on the server stalls the stream (the client goes on
    sending, the server receives nothing more), and lifting it lets TCP deliver what waited."""
    # Its nc prints what it receives; its stdin (a sleep) never ends, so nc never closes its half.
    core.create_namespaced_pod(namespace, shell_pod("sink", "sleep 3600 | nc -l -p 9000", node=1,
                                                    labels={"app": "sink"}))
    sink_ip = wait_for(lambda: core.read_namespaced_pod("sink", namespace).status,
                       lambda st: st.phase == "Running" and st.pod_ip, timeout=timeouts.POD_START,
                       description="pod sink Running with an address").pod_ip
    core.create_namespaced_pod(namespace, shell_pod(
        "streamer", f"i=0; while true; do i=$((i+1)); echo tick-$i; echo sent-$i >&2; sleep 1; done | nc {sink_ip} 9000",
        node=NODES))

    def last(pod: str, word: str) -> int:
        counts = re.findall(rf"\b{word}-(\d+)\b", core.read_namespaced_pod_log(pod, namespace))
        return int(counts[-1]) if counts else 0

    def ticks() -> tuple[int, int]:
        return last("streamer", "sent"), last("sink", "tick")

    wait_for(ticks, lambda t: t[1] >= 3, timeout=timeouts.POD_START,
             description=f"the sink ({sink_ip}:9000) to receive the streamer's ticks (sent, received)")
    policies = client.NetworkingV1Api(platform.api_client())
    policies.create_namespaced_network_policy(namespace, {
        "metadata": {"name": "sink-deny-ingress", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "sink"}}, "policyTypes": ["Ingress"]}})
    stalled = wait_for(ticks, lambda t: t[0] >= t[1] + 5, timeout=timeouts.CONTROLLER_RECONCILE,
                       description="the deny-ingress policy to stall the open connection: the streamer five ticks "
                                   "ahead of what the sink received (sent, received)")
    policies.delete_namespaced_network_policy("sink-deny-ingress", namespace)
    wait_for(ticks, lambda t: t[1] > stalled[0], timeout=timeouts.CONTROLLER_RECONCILE,
             description=f"the sink to receive the ticks held back (past tick {stalled[0]}) once the policy "
                         "was lifted (sent, received)")


def test_the_api_servers_proxy_into_a_pod_is_traffic_its_policies_judge(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """The API server's service proxy, KubeRay's way to Ray dashboards here, enters the pod network
    from the API server's address there, and the pod's NetworkPolicies judge it as on a real cluster
    (issue 14: on the node agent it came from the router itself and no policy saw it)."""
    core.create_namespaced_pod(namespace, shell_pod(
        "web", "mkdir -p /www && echo proxied > /www/index.html && httpd -f -p 8080 -h /www", labels={"app": "web"}))
    wait_for(lambda: core.read_namespaced_pod("web", namespace).status.phase, lambda ph: ph == "Running",
             timeout=timeouts.POD_START, description="pod web Running")

    def via_proxy() -> subprocess.CompletedProcess[str]:
        return kubectl(platform, "get", "--raw", f"/api/v1/namespaces/{namespace}/pods/web:8080/proxy/",
                       check=False)
    wait_for(via_proxy, lambda r: "proxied" in r.stdout, timeout=timeouts.CONTAINER_TRANSITION,
             description="the API server's proxy to fetch pod web's page")
    policies = client.NetworkingV1Api(platform.api_client())
    policies.create_namespaced_network_policy(namespace, {
        "metadata": {"name": "web-same-namespace", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {}}]}]}})
    cut = wait_for(via_proxy, lambda r: r.returncode != 0, timeout=timeouts.CONTROLLER_RECONCILE,
                   description="a policy admitting only the namespace's pods to cut the API server's proxy off")
    assert "proxied" not in cut.stdout, cut.stdout
    policies.create_namespaced_network_policy(namespace, {
        "metadata": {"name": "web-api-server", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"ipBlock": {"cidr": f"{ROUTER_IP}/32"}}],
                              "ports": [{"protocol": "TCP", "port": 8080}]}]}})
    wait_for(via_proxy, lambda r: "proxied" in r.stdout, timeout=timeouts.CONTROLLER_RECONCILE,
             description=f"a policy admitting the API server's address {ROUTER_IP} to let its proxy in again")


def test_a_policy_holds_from_a_new_pods_first_packet(core: client.CoreV1Api, namespace: str) -> None:
    """As a real CNI isolates a pod before its containers start: a pod an egress policy cuts off cannot
    connect even with the first thing its container does (kube-router's default deny rejects a pod's
    traffic until its chain is written); a pod no policy selects, started alike, gets through once its
    chain is."""
    core.create_namespaced_pod(namespace, shell_pod(
        "origin", "mkdir -p /www && echo served > /www/index.html && httpd -f -p 8080 -h /www", node=1))
    server = wait_for(lambda: core.read_namespaced_pod("origin", namespace).status,
                      lambda st: st.phase == "Running" and st.pod_ip, timeout=timeouts.POD_START,
                      description="pod origin Running with an address").pod_ip
    client.NetworkingV1Api(core.api_client).create_namespaced_network_policy(namespace, {
        "metadata": {"name": "no-egress", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "isolated"}}, "policyTypes": ["Egress"]}})
    attempt = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {server} 8080 2>/dev/null | grep -q served"
    # Each container's first command is the connection; then it tries once a second for 20 s.
    script = (f"if {attempt}; then echo first=reached; else echo first=cut; fi; "
              f"i=0; while [ $i -lt 20 ]; do i=$((i+1)); if {attempt}; then echo reached-after=$i; break; fi; "
              "sleep 1; done; echo done; sleep 3600")
    for name in ("isolated", "free"):
        core.create_namespaced_pod(namespace, shell_pod(name, script, node=NODES, labels={"app": name}))
    logs = {name: wait_for(lambda n=name: core.read_namespaced_pod_log(n, namespace),
                           lambda log: "done" in log.split(), timeout=timeouts.POD_START,
                           description=f"pod {name} to try its connections to {server}:8080").split()
            for name in ("isolated", "free")}
    assert logs["isolated"] == ["first=cut", "done"], (
        f"a pod its egress policy cuts off reached {server}: {logs['isolated']} (first=reached: its first "
        "packets passed before the policy applied to it)")
    assert any(word.startswith(("first=reached", "reached-after=")) for word in logs["free"]), logs["free"]


def test_cluster_dns_is_coredns_pods_and_a_pods_egress_policy_governs_its_dns(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """Cluster DNS is CoreDNS pods behind kube-dns (the router serves none), they reach the API server
    through ``kubernetes.default``, and a pod's DNS is pod-to-pod traffic that its NetworkPolicies judge:
    denying its egress cuts its DNS, allowing port 53 gives it back (issue 14: on the node agent, DNS
    answered from the router and bypassed policy)."""
    from clusters.embedded.nodes import dns

    service = core.read_namespaced_service("kube-dns", dns.NAMESPACE)
    assert service.spec.cluster_ip == DNS_IP
    pods = core.list_namespaced_pod(dns.NAMESPACE, label_selector="k8s-app=kube-dns").items
    assert pods and {p.spec.containers[0].image for p in pods} == {COREDNS_IMAGE}
    assert all(p.status.phase == "Running" and p.status.pod_ip for p in pods), [p.status for p in pods]
    core.create_namespaced_pod(namespace, shell_pod("dns-client", "sleep 3600", labels={"app": "dns-client"}))
    wait_for(lambda: core.read_namespaced_pod("dns-client", namespace).status.phase, lambda ph: ph == "Running",
             timeout=timeouts.POD_START, description="pod dns-client Running")

    def run(script: str) -> subprocess.CompletedProcess[str]:
        return kubectl(platform, "-n", namespace, "exec", "dns-client", "--", "sh", "-c", script, check=False)

    def lookup() -> subprocess.CompletedProcess[str]:
        return run("timeout 5 nslookup kubernetes.default.svc.cluster.local")

    answered = wait_for(lookup, lambda r: FIRST_SERVICE_IP in r.stdout, timeout=timeouts.CONTAINER_TRANSITION,
                        description="kubernetes.default's address from cluster DNS")
    assert DNS_IP in answered.stdout, answered.stdout  # the pod's resolv.conf server, kubelet's clusterDNS
    # The API server behind kubernetes.default answers a pod (TLS handshake, then HTTP 401/403 without a token).
    api = run("timeout 5 nc -w 3 kubernetes.default.svc 443 </dev/null && echo connected")
    assert "connected" in api.stdout, (api.stdout, api.stderr)

    policies = client.NetworkingV1Api(platform.api_client())
    policies.create_namespaced_network_policy(namespace, {
        "metadata": {"name": "dns-client-no-egress", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "dns-client"}}, "policyTypes": ["Egress"]}})
    cut = wait_for(lookup, lambda r: FIRST_SERVICE_IP not in r.stdout, timeout=timeouts.CONTROLLER_RECONCILE,
                   description="an egress policy allowing nothing to cut dns-client's DNS")
    assert cut.returncode != 0, cut.stdout
    policies.create_namespaced_network_policy(namespace, {
        "metadata": {"name": "dns-client-dns", "labels": LABELS},
        "spec": {"podSelector": {"matchLabels": {"app": "dns-client"}}, "policyTypes": ["Egress"],
                 "egress": [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]}})
    wait_for(lookup, lambda r: FIRST_SERVICE_IP in r.stdout, timeout=timeouts.CONTROLLER_RECONCILE,
             description="an egress policy allowing port 53 to give dns-client its DNS back")


def test_claims_get_volumes_shared_by_every_node_or_each_nodes_own(core: client.CoreV1Api, namespace: str) -> None:
    """The StorageClasses' provisioner: a shared claim's files are seen from another node, a node-local
    claim's are not; both are writable by a user that is not root (Ray's image runs as uid 1000)."""
    for claim, storage_class in (("shared", None), ("local", "rayproof-node-local")):
        spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
        if storage_class:
            spec["storageClassName"] = storage_class
        core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": claim, "labels": LABELS},
                                                                   "spec": spec})

    def run(name: str, node: int, script: str) -> str:
        pod = shell_pod(name, script, node=node)
        pod["spec"].update(restartPolicy="Never", securityContext={"runAsUser": 1000, "runAsGroup": 100},
                           volumes=[{"name": c, "persistentVolumeClaim": {"claimName": c}} for c in ("shared", "local")])
        pod["spec"]["containers"][0]["volumeMounts"] = [{"name": c, "mountPath": f"/{c}"} for c in ("shared", "local")]
        core.create_namespaced_pod(namespace, pod)
        phase = wait_for(lambda: core.read_namespaced_pod(name, namespace).status.phase,
                         lambda ph: ph in ("Succeeded", "Failed"), timeout=timeouts.POD_START,
                         description=f"pod {name} (claims shared and local) to run to its end")
        log = core.read_namespaced_pod_log(name, namespace)
        assert phase == "Succeeded", log
        return log

    run("writer", 1, "echo from-node-1 > /shared/f && echo from-node-1 > /local/f")
    assert run("reader-other", NODES, "cat /shared/f; ls /local").split() == ["from-node-1"]
    assert run("reader-same", 1, "cat /shared/f /local/f").split() == ["from-node-1", "from-node-1"]


def test_the_profiles_redis_image_serves_a_gcs_store_behind_its_password(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """The Redis a team deploys for GCS fault tolerance (``fixtures.manifests.gcs_redis``), from the
    profile's default image: Debian's redis-server, pulled from the registry, asking for its password."""
    from core import profile
    from fixtures import manifests as mf

    image = profile.load().data["gcsFaultTolerance"]["redisImage"]
    pod, service, policy = mf.gcs_redis("gcs-redis", LABELS, image, {"value": "s3cret"})
    core.create_namespaced_pod(namespace, pod)
    core.create_namespaced_service(namespace, service)
    client.NetworkingV1Api(platform.api_client()).create_namespaced_network_policy(namespace, policy)
    wait_for(lambda: core.read_namespaced_pod("gcs-redis", namespace).status.conditions or [],
             lambda conds: any(c.type == "Ready" and c.status == "True" for c in conds),
             timeout=timeouts.POD_START, description=f"the Redis pod of {image} Ready")
    # A Ray pod (the policy admits pods with ray.io/cluster) asks without and with the password.
    asker = shell_pod("ray-asker", "sleep 3600", labels={"ray.io/cluster": "any"})
    core.create_namespaced_pod(namespace, asker)
    wait_for(lambda: core.read_namespaced_pod("ray-asker", namespace).status.phase, lambda ph: ph == "Running",
             timeout=timeouts.POD_START, description="pod ray-asker Running")
    said = wait_for(lambda: kubectl(platform, "-n", namespace, "exec", "ray-asker", "--", "sh", "-c",
                                    "printf 'PING\\r\\nAUTH s3cret\\r\\nPING\\r\\n' | nc -w 3 gcs-redis 6379",
                                    check=False).stdout,
                    lambda out: "PONG" in out, timeout=timeouts.CONTAINER_TRANSITION,
                    description="Redis to answer PING once authenticated")
    assert said.split() == ["-NOAUTH", "Authentication", "required.", "+OK", "+PONG"], said


def kuberay_sample(name: str) -> dict[str, Any]:
    """One of KubeRay's own samples, from the pinned ray-operator module, with the Ray image's name swapped in."""
    text = (build.manifests_dir() / "kuberay" / "samples" / name).read_text()
    images = set(re.findall(r"image: (rayproject/ray:[0-9.]+)", text))
    assert len(images) == 1, images  # the sample names one Ray image; it is the only thing changed
    return yaml.safe_load(text.replace(images.pop(), rayimage.image_name()))


def test_every_node_holds_the_ray_image_pulled_at_up_with_the_suites_ray_and_torch(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """The Ray image is Debian's Python with the pinned Ray and torch. The platform's pre-pull
    (profile nodes.prepullImages) had each node pull it from the registry during up, one node at a
    time, so the pre-puller DaemonSet's pods and any pod of it after start from the node's copy."""
    from clusters.embedded.nodes import prepull

    assert platform.profile.prepull_images == ["rayproject/ray:2.60.0"]  # the golden templates' name for it
    pulls = {e.involved_object.name: e.message for e in core.list_namespaced_event(prepull.NAMESPACE).items
             if e.reason == "Pulled" and '"rayproject/ray:2.60.0"' in (e.message or "")}
    print(f"pre-pulled at up: {pulls}")  # kubelet's pull time and the image's size, per pod
    warmed = {name: m for name, m in pulls.items() if name.startswith("image-warm-up-")}
    daemons = {name: m for name, m in pulls.items() if name.startswith(prepull.NAME)}
    assert len(warmed) == NODES and all("Successfully pulled" in m for m in warmed.values()), pulls
    assert len(daemons) == NODES and all("already present on machine" in m for m in daemons.values()), pulls
    for node in range(1, NODES + 1):
        script = ("id -u; python -c 'import ray, torch; from importlib.metadata import version; "
                  "print(version(\"ray\"), version(\"torch\"), torch.__version__)'")
        pod = shell_pod(f"ray-{node}", script, node=node, memory="1Gi", image=rayimage.image_name())
        pod["spec"]["restartPolicy"] = "Never"
        pod["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "1"  # importing torch takes a core
        core.create_namespaced_pod(namespace, pod)
    for node in range(1, NODES + 1):
        name = f"ray-{node}"
        wait_for(lambda n=name: core.read_namespaced_pod(n, namespace).status.phase, lambda ph: ph == "Succeeded",
                 timeout=timeouts.POD_START, description=f"pod {name} (the Ray image, pre-pulled) to run and succeed")
        said = core.read_namespaced_pod_log(name, namespace).split()
        # uid 1000 as in Ray's own images; the image's Ray and torch are the suite's pinned ones.
        assert said[:3] == ["1000", metadata.version("ray"), metadata.version("torch")], said
        assert said[3].split("+")[0] == metadata.version("torch"), said  # torch's own name for itself, +cu132
        pulled = [e.message for e in core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
                  if e.reason == "Pulled"]
        assert pulled and all("already present on machine" in m for m in pulled), pulled


def test_the_nodes_unpacked_ray_image_is_held_once_and_a_containers_write_stays_its_own(
        platform: EmbeddedPlatform, core: client.CoreV1Api, namespace: str) -> None:
    """After the pre-pull, ``up`` made every file of the second node's unpacked Ray image a hard link
    to the first node's (``nodes/sharedlayers.py``), so the machine holds it once. A container that
    writes to one of those files writes its own copy: a pod of the other node, and the shared file
    itself, still read what the image holds."""
    from clusters.embedded.nodes import layer, sharedlayers

    pids = layer.containerd_pids(platform)
    stores = [sharedlayers.snapshot_directories(n, pids[n.name]) for n in layer.nodes_of(platform)]
    ray_init = "usr/local/lib/python3.11/dist-packages/ray/__init__.py"
    holding, = (key for key in stores[0].keys() & stores[1].keys() if (stores[0][key] / ray_init).exists())
    first, second = stores[0][holding], stores[1][holding]
    files = [Path(d, name) for d, _, names in os.walk(second) for name in names]
    not_shared = [str(f) for f in files if f.is_file() and not f.is_symlink()
                  and not os.path.samefile(f, first / f.relative_to(second))]
    print(f"{len(files)} files in the second node's snapshot of the Ray layer, {len(not_shared)} not shared")
    assert len(files) > 10_000 and not_shared == []
    image_holds = (first / ray_init).read_bytes()[-12:].decode()

    def run_alone(name: str, script: str, node: int) -> str:
        pod = shell_pod(name, script, node=node, image=rayimage.image_name())
        pod["spec"].update(restartPolicy="Never", securityContext={"runAsUser": 0})  # root may write the image's files
        core.create_namespaced_pod(namespace, pod)
        wait_for(lambda: core.read_namespaced_pod(name, namespace).status.phase, lambda ph: ph == "Succeeded",
                 timeout=timeouts.POD_START, description=f"pod {name} on node {node} to run and succeed")
        return core.read_namespaced_pod_log(name, namespace)

    assert run_alone("writer", f"echo CHANGED >> /{ray_init} && tail -c 8 /{ray_init}", node=1) == "CHANGED\n"
    assert run_alone("reader", f"tail -c 12 /{ray_init}", node=2) == image_holds
    assert (first / ray_init).read_bytes()[-12:].decode() == image_holds
    assert os.path.samefile(first / ray_init, second / ray_init)


def test_kuberay_ray_cluster_sample_runs_unchanged_but_for_its_image(
        platform: EmbeddedPlatform, namespace: str) -> None:
    """KubeRay's ray-cluster.sample.yaml: head and worker Ready, and Ray sees both nodes."""
    custom = client.CustomObjectsApi(platform.api_client())
    sample = kuberay_sample("ray-cluster.sample.yaml")
    name = sample["metadata"]["name"]
    custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", sample)
    try:
        wait_for(lambda: (custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", name)
                          .get("status") or {}).get("state"), lambda state: state == "ready",
                 timeout=timeouts.RAYCLUSTER_READY, description=f"RayCluster {name} ready")
        head = kubectl(platform, "-n", namespace, "get", "pods", "-l", f"ray.io/cluster={name},ray.io/node-type=head",
                       "-o", "jsonpath={.items[0].metadata.name}").stdout
        alive = kubectl(platform, "-n", namespace, "exec", head, "--", "python", "-c",
                        "import ray; ray.init(); print('alive', sum(n['Alive'] for n in ray.nodes()))")
        assert "alive 2" in alive.stdout, alive.stdout + alive.stderr
    finally:
        custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", name)
    core = client.CoreV1Api(platform.api_client())
    wait_for(lambda: core.list_namespaced_pod(namespace, label_selector=f"ray.io/cluster={name}").items,
             lambda pods: not pods, timeout=timeouts.OBJECT_DELETE, description=f"the pods of RayCluster {name} gone")


def test_kuberay_kueue_toy_sample_is_admitted_through_a_teams_queue_and_runs(platform: EmbeddedPlatform) -> None:
    """KubeRay's ray-job.kueue-toy-sample.yaml in a team's namespace, naming the team's LocalQueue:
    Kueue admits it, KubeRay starts its Ray cluster on the nodes and its job prints what Ray sees."""
    core = client.CoreV1Api(platform.api_client())
    custom = client.CustomObjectsApi(platform.api_client())
    team = f"rayproof-toy-{RUN}"
    core.create_namespace({"metadata": {"name": team, "labels": {
        **LABELS, "onboarding.rayproof.io/class": "standard", "onboarding.rayproof.io/tenant": team}}})
    try:
        wait_for(lambda: custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", team, "localqueues", "team"),
                 timeout=timeouts.CONTROLLER_RECONCILE, ignore=(client.ApiException,),
                 description=f"the onboarding to give namespace {team} its LocalQueue team")
        sample = kuberay_sample("ray-job.kueue-toy-sample.yaml")
        sample["metadata"]["labels"] = {**LABELS, "kueue.x-k8s.io/queue-name": "team"}
        name = custom.create_namespaced_custom_object("ray.io", "v1", team, "rayjobs", sample)["metadata"]["name"]
        wait_for(lambda: (custom.get_namespaced_custom_object("ray.io", "v1", team, "rayjobs", name)
                          .get("status") or {}).get("jobStatus"), lambda status: status == "RUNNING",
                 timeout=timeouts.RAYCLUSTER_READY, description=f"RayJob {name} admitted and RUNNING")
        workload, = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", team, "workloads")["items"]
        admitted = {c["type"]: c["status"] for c in workload["status"]["conditions"]}
        assert admitted.get("Admitted") == "True", workload["status"]
        submitter = core.list_namespaced_pod(team, label_selector=f"job-name={name}").items[0].metadata.name
        line = wait_for(lambda: core.read_namespaced_pod_log(submitter, team), lambda log: "iter: 1," in log,
                        timeout=timeouts.RAY_JOIN, ignore=(client.ApiException,),
                        description=f"the job of RayJob {name} to print what Ray sees")
        # The head's and the worker's CPU: Ray on both pods of the cluster.
        assert "'CPU': 2.0" in line, line
    finally:
        core.delete_namespace(team)


def test_a_node_short_of_memory_evicts_the_pod_furthest_over_its_requests(tmp_path: Path) -> None:
    """A platform of one node offering 1 GiB: a BestEffort pod holds more than the node offers.
    Kubelet's eviction manager, not the kernel, ends it: allocatable memory available
    (the pods' cgroup limit, allocatable plus the 100Mi threshold, less their working set) falls under
    kubelet's default memory.available threshold, so the pod is Failed, reason Evicted, the node reports
    MemoryPressure, and a Guaranteed pod within its requests on the same node keeps running."""
    name = f"kubelet-evict-{os.getpid()}"
    p = EmbeddedPlatform(name, run_dir=tmp_path / "platform", profile={"nodes": {
        "runtime": "kubelet", "count": 1, "shape": {"cpu": "2", "memory": "1Gi", "nvidia.com/gpu": 0},
        "prepullImages": []}})
    with host_slot():
        try:
            p.up(wait_for_room=True)
            core = client.CoreV1Api(p.api_client())
            calm = shell_pod("calm", "sleep 3600", memory="16Mi")
            calm["spec"]["containers"][0]["resources"]["requests"] = {"memory": "16Mi", "cpu": "100m"}
            core.create_namespaced_pod("default", calm)
            # dd's one block, read from /dev/zero (every page touched) and held while dd waits to write it
            # into a pipe nobody reads: 10 MiB past the 1 GiB offered, so with the other pods' few MiB the
            # pods' working set passes kubelet's threshold and stays short of their cgroup's limit (1 GiB +
            # 100Mi): kubelet evicts, the kernel kills nothing.
            hog = shell_pod("hog", "dd if=/dev/zero bs=1034M count=1 | sleep 3600")
            hog["spec"]["containers"][0]["resources"] = {}  # BestEffort: the furthest over its requests
            core.create_namespaced_pod("default", hog)
            pod = wait_for(lambda: core.read_namespaced_pod("hog", "default"),
                           lambda pod: pod.status.phase == "Failed", timeout=timeouts.CONTAINER_TRANSITION,
                           description="kubelet to evict pod hog once it held 1034 MiB on a 1 GiB node")
            assert pod.status.reason == "Evicted" and "low on resource: memory" in (pod.status.message or ""), (
                pod.status.reason, pod.status.message)
            terminated = [s.state.terminated or s.last_state.terminated for s in pod.status.container_statuses or []]
            assert not [t for t in terminated if t is not None and t.reason == "OOMKilled"], terminated
            node = core.read_node("rayproof-node-1")
            pressure = {c.type: c.status for c in node.status.conditions}
            assert pressure.get("MemoryPressure") == "True", pressure  # held for evictionPressureTransitionPeriod
            assert "node.kubernetes.io/memory-pressure" in {t.key for t in node.spec.taints or []}, node.spec.taints
            assert core.read_namespaced_pod("calm", "default").status.phase == "Running"
            events = core.list_namespaced_event("default", field_selector="involvedObject.name=hog").items
            assert any(e.reason == "Evicted" and e.source.component == "kubelet" for e in events), (
                [(e.source.component, e.reason, e.message) for e in events])
        finally:
            p.down()


def test_down_leaves_no_process_namespace_cgroup_or_host_path(tmp_path: Path) -> None:
    """A second platform of one node: after down, nothing of it is left on the machine."""
    name = f"kubelet-down-{os.getpid()}"
    run_dir = tmp_path / "platform"
    p = EmbeddedPlatform(name, run_dir=run_dir, profile={"nodes": {"runtime": "kubelet", "count": 1,
                                                                "prepullImages": []}})
    node = node_mod.cgroup_root(name, "rayproof-node-1")
    before = set(node_mod.host_leaks())
    with host_slot():
        try:
            p.up(wait_for_room=True)
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
    """SIGKILL of the process running up() once a kubelet runs: ``rayproof clean``'s sweep finds the
    platform in its temporary run directory, and its down() from another process still stops
    containerd, kubelet and what they started, and removes the nodes' namespaces and cgroups."""
    name = f"kubelet-kill-{os.getpid()}"
    run_dir = tmp_path / "platform"
    profile = tmp_path / "profile.yaml"
    profile.write_text("nodes:\n  runtime: kubelet\n  count: 1\n  prepullImages: []\n")
    sup = Supervisor(run_dir)
    before = set(node_mod.host_leaks())
    with host_slot():
        starter = subprocess.Popen(
            [sys.executable, "-m", "clusters.embedded.platform", "up", "--name", name, "--run-dir", str(run_dir),
             "--profile", str(profile), "--wait-for-room"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        p = EmbeddedPlatform(name, run_dir=run_dir, profile=profile)
        try:
            wait_for(lambda: sup.running("kubelet-1"), timeout=timeouts.PLATFORM_ROOM,  # beside a test run's others
                     description="the starter to have found room and started the node's kubelet")
            os.kill(starter.pid, signal.SIGKILL)
            starter.wait()
            records = sup.records()
            done = janitor.take_down_platforms_elsewhere()
            assert f"took down embedded platform {name} in {run_dir.resolve()}" in " ".join(done), done
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
