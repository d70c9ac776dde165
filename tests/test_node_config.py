"""The real nodes' configuration, checked without running it: what the profile's node shape becomes in
kubelet's configuration, cluster DNS's objects, the relay's addresses."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from clusters.embedded.nodes import dns, oomgroup
from clusters.embedded.nodes.images import COREDNS_IMAGE
from clusters.embedded.nodes.node import Node, system_reserved
from clusters.embedded.nodes.relay import _expose
from clusters.embedded.podnet import DNS_IP

GIB = 2**30


def test_a_shape_smaller_than_the_machine_is_reserved_down_to_with_the_eviction_threshold_counted_in() -> None:
    reserved, short = system_reserved({"cpu": "4", "memory": "16Gi"}, cpus=8, memory_bytes=24 * GIB)
    # allocatable = capacity - systemReserved - evictionHard memory.available (100Mi) = 16Gi, 4 CPUs
    assert reserved == {"cpu": "4000m", "memory": f"{8 * 1024 - 100}Mi"}
    assert short == []


def test_what_the_machine_lacks_is_named_and_not_reserved() -> None:
    reserved, short = system_reserved({"cpu": "4", "memory": "16Gi"}, cpus=2, memory_bytes=24 * GIB)
    assert reserved == {"memory": f"{8 * 1024 - 100}Mi"}
    assert short == ["cpu 4: the machine has 2"]
    reserved, short = system_reserved({"cpu": "500m", "memory": "32Gi"}, cpus=2, memory_bytes=24 * GIB)
    assert reserved == {"cpu": "1500m"}
    assert short == ["memory 32Gi: the machine has 24.0Gi"]


def test_a_shape_equal_to_the_machine_or_silent_on_a_resource_reserves_nothing() -> None:
    assert system_reserved({"cpu": "2"}, cpus=2, memory_bytes=24 * GIB) == ({}, [])
    assert system_reserved({"nvidia.com/gpu": "8"}, cpus=2, memory_bytes=24 * GIB) == ({}, [])


def test_the_reservation_is_in_kubelets_configuration_and_absent_when_empty(tmp_path: Path) -> None:
    node = Node("p", 1, "rayproof-node-1", tmp_path, tmp_path)
    files = dict(ca_file=tmp_path / "ca.crt", serving_cert=tmp_path / "s.crt", serving_key=tmp_path / "s.key")
    cfg = yaml.safe_load(node._kubelet_yaml(**files, reserved={"memory": "8092Mi"}))
    assert cfg["systemReserved"] == {"memory": "8092Mi"}
    assert cfg["evictionHard"]["memory.available"] == "100Mi"
    assert "systemReserved" not in yaml.safe_load(node._kubelet_yaml(**files, reserved={}))


def test_cluster_dns_is_kubeadms_coredns_at_the_kubelets_cluster_dns_address_with_nothing_forwarded() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in dns.documents()}
    service = docs[("Service", "kube-dns")]
    assert service["metadata"]["namespace"] == "kube-system" and service["spec"]["clusterIP"] == DNS_IP
    deployment = docs[("Deployment", "coredns")]
    pod = deployment["spec"]["template"]["spec"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    assert pod["containers"][0]["image"] == COREDNS_IMAGE and pod["serviceAccountName"] == "coredns"
    corefile = docs[("ConfigMap", "coredns")]["data"]["Corefile"]
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa" in corefile
    assert "forward" not in corefile  # no query leaves the machine
    # What the Corefile names is what the build's main imports (gomod/coredns/main.go).
    plugins = {line.split()[0] for line in corefile.splitlines()[1:] if line.startswith("    ") and
               not line.startswith("     ") and line.strip() not in ("}",)}
    main_go = (Path(dns.__file__).parents[1] / "gomod" / "coredns" / "main.go").read_text()
    directive = {"prometheus": "metrics"}
    assert plugins and all(f"plugin/{directive.get(p, p)}\"" in main_go for p in plugins), plugins
    role = docs[("ClusterRole", "system:coredns")]
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"list", "watch"}  # reads, never writes


def test_the_relay_exposes_an_address_in_a_namespace_and_refuses_a_malformed_one() -> None:
    assert _expose("rayproof-p-net=198.18.0.1:6443=40123") == ("rayproof-p-net", "198.18.0.1", 6443, 40123)
    for bad in ("rayproof-p-net=198.18.0.1:6443", "=198.18.0.1:1=2", "ns=:1=2", "ns=198.18.0.1:x=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            _expose(bad)


def test_the_certificate_names_what_runs_the_nodes_for_every_runtime_a_profile_may_choose() -> None:
    from clusters.embedded.profile import NODE_RUNTIMES
    from clusters.embedded.target import KINDS

    assert set(KINDS) == set(NODE_RUNTIMES) == {"kubelet"}
    assert "kubelet" in KINDS["kubelet"] and "node agent" not in KINDS["kubelet"]


def test_the_retired_node_agent_is_refused_by_name_and_kubelet_is_the_default() -> None:
    from clusters.embedded.profile import ProfileError, load_profile

    assert load_profile(None).node_runtime == "kubelet"
    assert load_profile({"nodes": {"runtime": "kubelet"}}).node_runtime == "kubelet"  # profiles that name it load
    with pytest.raises(ProfileError, match=r"nodes.runtime: must be kubelet \(the project's node agent retired"):
        load_profile({"nodes": {"runtime": "agent"}})


def test_the_certificate_gives_what_nodes_offer_pods_and_their_capacity_where_it_differs():
    from clusters.existing import node_shape

    # Real nodes: kubelet's systemReserved holds 8Gi of the machine's 24 back from pods.
    assert node_shape({"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": "8"},
                      {"cpu": "2", "memory": "24Gi", "nvidia.com/gpu": "8"}) == \
        "allocatable cpu=2, memory=16Gi, nvidia.com/gpu=8 (capacity memory=24Gi)"
    # A node whose allocatable equals its capacity names it once; a node without GPUs offers none.
    assert node_shape({"cpu": "4", "memory": "16Gi"}, {"cpu": "4", "memory": "16Gi"}) == \
        "allocatable cpu=4, memory=16Gi, nvidia.com/gpu=0"


def test_the_pre_puller_runs_each_image_as_an_init_container_on_every_node() -> None:
    from clusters.embedded.nodes import prepull
    from clusters.embedded.nodes.images import PAUSE_IMAGE
    from clusters.embedded.profile import load_profile

    images = load_profile().prepull_images
    spec = prepull.daemonset(images)["spec"]["template"]["spec"]
    golden = Path(__file__).resolve().parents[1] / "clusters/embedded/golden"
    template_images = {line.split("image:", 1)[1].strip() for f in golden.glob("*.yaml")
                       for line in f.read_text().splitlines() if line.strip().startswith("image:")}
    assert set(images) == template_images, "the default pre-pulls the golden templates' images"
    assert [(c["image"], c["command"]) for c in spec["initContainers"]] == [(i, ["true"]) for i in images]
    assert [c["image"] for c in spec["containers"]] == [PAUSE_IMAGE]
    assert spec["tolerations"] == [{"operator": "Exists"}], "every node, tainted or not"
    assert load_profile({"nodes": {"prepullImages": []}}).prepull_images == []
    # A 2-CPU node keeps its two CPUs for a 1-CPU head and a 1-CPU worker
    # (a request, even 1m, would keep the worker off it).
    from kubernetes.utils import parse_quantity
    for container in spec["initContainers"] + spec["containers"]:
        assert parse_quantity(container["resources"]["requests"]["cpu"]) == 0, container["name"]


@pytest.mark.parametrize("value", ["rayproject/ray:2.60.0", ["a", "a"], ["bad image"], [7]])
def test_pre_pull_images_must_be_a_list_of_distinct_references(value: object) -> None:
    from clusters.embedded.profile import ProfileError, load_profile

    with pytest.raises(ProfileError, match="nodes.prepullImages"):
        load_profile({"nodes": {"prepullImages": value}})


def test_the_oom_group_reads_containerds_task_events_of_containers_and_nothing_else() -> None:
    at = "2026-12-05 07:30:00.123456789 +0000 UTC k8s.io"
    assert oomgroup.task_event(f'{at} /tasks/oom {{"container_id":"4f1e0c2a9b"}}\n') == (
        "/tasks/oom", ("k8s.io", "4f1e0c2a9b"))
    assert oomgroup.task_event(f'{at} /tasks/start {{"container_id":"4f1e","pid":7}}') == (
        "/tasks/start", ("k8s.io", "4f1e"))
    assert oomgroup.task_event(f'{at} /tasks/exit {{"container_id":"4f1e","id":"4f1e","exit_status":137}}') == (
        "/tasks/exit", ("k8s.io", "4f1e"))
    for other in (f'{at} /tasks/exit {{"container_id":"4f1e","id":"probe-1","exit_status":0}}',  # an exec's exit
                  f'{at} /tasks/oom {{}}', f'{at} /tasks/oom not-json', f'{at} /images/update {{"name":"x"}}',
                  '/tasks/oom', ''):
        assert oomgroup.task_event(other) is None, other


def test_the_oom_group_kills_a_started_container_at_its_oom_and_a_starting_one_once_started() -> None:
    group, a, b = oomgroup.OomGroup(lambda container, last: (True, last + 1)), ("k8s.io", "a"), ("k8s.io", "b")
    assert group.on_event("/tasks/oom", a) == [a]  # created before the group followed the events
    for topic in ("/tasks/create", "/tasks/start"):
        assert group.on_event(topic, b) == []
    assert group.on_event("/tasks/oom", b) == [b]  # started: at once
    # An OOM while its start is under way: a kill then once failed the start (StartError, 128).
    c = ("k8s.io", "c")
    assert group.on_event("/tasks/create", c) == []
    assert group.on_event("/tasks/oom", c) == []
    assert group.on_event("/tasks/start", c) == [c]
    assert group.on_event("/tasks/start", c) == []  # killed once
    # One whose start failed ends without a start: nothing is left waiting.
    d = ("k8s.io", "d")
    for topic in ("/tasks/create", "/tasks/oom", "/tasks/exit"):
        assert group.on_event(topic, d) == []
    assert not group.starting and not group.oom_while_starting


def test_the_oom_group_kills_only_the_container_the_kernel_killed_in(tmp_path: Path, monkeypatch) -> None:
    """A pod's cgroup at its limit: cgroup v1 reports the OOM to every container of the pod, the pause
    container among them; only the one whose oom_kill count rose is killed, as cgroup v2's group kill."""
    counts = {("k8s.io", "main"): 1, ("k8s.io", "pause"): 0}
    group = oomgroup.OomGroup(lambda container, last: (counts[container] > last, counts[container]))
    for container in counts:
        for topic in ("/tasks/create", "/tasks/start"):
            group.on_event(topic, container)
    assert group.on_event("/tasks/oom", ("k8s.io", "pause")) == []
    assert group.on_event("/tasks/oom", ("k8s.io", "main")) == [("k8s.io", "main")]
    assert group.on_event("/tasks/oom", ("k8s.io", "main")) == []  # the same kill, reported again
    counts[("k8s.io", "main")] = 2
    assert group.on_event("/tasks/oom", ("k8s.io", "main")) == [("k8s.io", "main")]

    cgroup = tmp_path / "pod1" / "c1"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert oomgroup.oom_kills(cgroup) == 3 and oomgroup.oom_kills(tmp_path / "gone") is None
    monkeypatch.setattr(oomgroup, "memory_cgroup", lambda ctr, namespace, container: cgroup)
    own_kill = oomgroup.counted_kill(["ctr"])
    assert own_kill(("k8s.io", "c1"), 2) == (True, 3)
    assert own_kill(("k8s.io", "c1"), 3) == (False, 3)  # no new kill within oom_kill_counted


def test_the_oom_group_kills_every_process_of_the_container_through_containerd(monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(oomgroup.subprocess, "run", lambda argv, **kw: ran.append(argv))
    oomgroup.kill_container(["/b/ctr", "--address", "/run/containerd/containerd.sock"], "k8s.io", "4f1e")
    assert ran == [["/b/ctr", "--address", "/run/containerd/containerd.sock", "-n", "k8s.io", "task", "kill",
                    "--all", "--signal", "SIGKILL", "4f1e"]]


def test_each_node_runs_kube_routers_firewall_alone_isolating_new_pods_in_its_own_namespaces(tmp_path: Path) -> None:
    from clusters.embedded.nodes.layer import process_names
    from clusters.embedded.nodes.node import in_node_exec_argvs

    node = Node("p", 2, "rayproof-node-2", tmp_path / "n2", tmp_path / "bin")
    argv = node.kube_router_argv(4242)
    assert argv[:4] == ["nsenter", "--target=4242", "--mount", "--net"], "in the node's namespaces, as kubelet"
    program = in_node_exec_argvs(argv)[-1]
    assert program[0] == str(tmp_path / "bin" / "kube-router")
    flags = program[1:]
    assert {"--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--netpol-default-deny=true",
            "--service-cluster-ip-range=198.19.0.0/16", "--health-port=0"} <= set(flags)
    assert flags[flags.index("--hostname-override") + 1] == "rayproof-node-2", "every node shares the hostname"
    assert process_names(2, gpus=False, policies=2)[-2:] == ["kube-router-1", "kube-router-2"], \
        "started once every node is registered"
    assert not any(n.startswith("kube-router") for n in process_names(2, gpus=False, policies=0))


@pytest.mark.parametrize("enforce, cuts, flags", [
    # The reference platform cuts open connections.
    (True, "default", ["--recheck-established"]),
    # null: the engine's own way (kube-router keeps them).
    (True, None, ["--no-network-policy"]),
    (True, False, ["--no-network-policy"]),
    # No engine at all: nothing to cut with.
    (False, True, ["--no-network-policy"]),
])
def test_which_engine_judges_policies_and_whether_it_cuts_open_connections(enforce, cuts, flags) -> None:
    """kube-router judges every connection in its node; the router's engine joins it, judging every
    packet that crosses the router, only to cut connections opened before a policy. kube-proxy alone
    translates Service addresses and serves node ports: the pod network has no flag for either."""
    from clusters.embedded.platform import pod_network_flags
    from clusters.embedded.profile import load_profile

    network: dict = {"enforceNetworkPolicy": enforce}
    if cuts != "default":
        network["policyCutsOpenConnections"] = cuts
    profile = load_profile({"network": network})
    assert pod_network_flags(profile) == flags
    assert profile.cuts_open_connections == ("--recheck-established" in flags)


def test_an_engine_on_some_nodes_guards_only_their_pods() -> None:
    """network.policyEngineNodes: N puts the engine on the first N nodes, the router's included."""
    from clusters.embedded.nodes.layer import process_names
    from clusters.embedded.platform import pod_network_flags
    from clusters.embedded.profile import load_profile

    profile = load_profile({"nodes": {"count": 4}, "network": {"policyEngineNodes": 2}})
    assert profile.policy_engine_nodes == ["rayproof-node-1", "rayproof-node-2"]
    assert pod_network_flags(profile)[-2:] == ["--policy-nodes", "rayproof-node-1,rayproof-node-2"]
    assert process_names(4, gpus=False, policies=2)[-2:] == ["kube-router-1", "kube-router-2"]
    assert load_profile({"nodes": {"count": 4}, "network": {"policyEngineNodes": 4}}).policy_engine_nodes is None
    unenforced = load_profile({"network": {"enforceNetworkPolicy": False, "policyEngineNodes": 1}})
    assert "--policy-nodes" not in pod_network_flags(unenforced)

