"""Bringing up the real node layer of an embedded platform (profile ``nodes.runtime: kubelet``).

Called by :class:`clusters.embedded.platform.EmbeddedPlatform` once the
control plane, the operators and the pod network's router run. First, per
node: its network namespace (``fabric.py``), certificates from the
platform's CA, its files and cgroup tree (``node.py``). Then the registry
with the node images pushed (``registry.py``, ``images.py``; the Ray image,
``rayimage.py``, built first when the registry lacks it), the registry's
slow path (``slowpull.py``), one ``relay`` process serving the API server,
the registry and its slow path inside every node namespace (and the API
server in the router's, at the address it advertises to pods), and the
StorageClasses' provisioner. Then per node containerd, its
``memory.oom.group`` on cgroup v1 (``oomgroup.py``), kubelet, kube-proxy
and (when the profile's node shape has ``nvidia.com/gpu``) the fake GPU
device plugin. Once the nodes are Ready the platform starts each node's
NetworkPolicy engine (``netpol.py``), then deploys cluster DNS on them
(``dns.py``), pre-pulls the golden templates' images (``prepull.py``) and
shares the nodes' unpacked copies of them (``sharedlayers.py``).
Nodes pull their images, the sandbox image included, from the registry as
any node does. ``down`` stops these programs like every platform process;
then the cleanup registered per node kills what is left in its cgroup tree
(shims, pods) and removes its namespace.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from clusters.embedded import build
from clusters.embedded.nodes import images as images_mod
from clusters.embedded.nodes import rayimage, registry, relay, sharedlayers
from clusters.embedded.nodes.fabric import OutsideNet
from clusters.embedded.nodes.host import NodeHost
from clusters.embedded.nodes.node import Node, env_for, in_node_exec_argvs, machine_capacity, system_reserved
from clusters.embedded.podnet import ROUTER_IP
from clusters.embedded.profile import NODE_NAME_PREFIX
from core import timeouts
from core.waiting import wait_for

NAME_PREFIX = NODE_NAME_PREFIX
# The programs each node runs, in start order, as its platform processes are
# named (``<kind>-<index>``); its NetworkPolicy engine starts once every node is Ready.
PER_NODE_KINDS = ("containerd", "oom-group", "kubelet", "kube-proxy", "fakegpu")
POLICY_ENGINE_KIND = "kube-router"


def nodes_of(platform: NodeHost) -> list[Node]:
    bin_dir = Path(platform.binaries()["kubelet"]).parent
    return [Node(platform.name, i, f"{NAME_PREFIX}-{i}", platform.run_dir / "nodes" / f"n{i}", bin_dir)
            for i in range(1, platform.profile.node_count + 1)]


def process_names(count: int, gpus: bool, policies: int) -> list[str]:
    """The platform processes of a node layer of ``count`` nodes, in start order (the
    NetworkPolicy engine of each of the first ``policies`` nodes, ``netpol.py``, once every
    node is Ready)."""
    kinds = [kind for kind in PER_NODE_KINDS if kind != "fakegpu" or gpus]
    return ["registry", "slow-pull", "relay", "provisioner",
            *(f"{kind}-{i}" for i in range(1, count + 1) for kind in kinds),
            *(f"{POLICY_ENGINE_KIND}-{i}" for i in range(1, min(policies, count) + 1))]


def _wait_answering(port: int, what: str) -> str:
    """Wait until the registry API on loopback ``port`` answers ``/v2/``; returns its base URL."""
    import urllib.request

    base = f"http://127.0.0.1:{port}"

    def answers() -> int:
        with urllib.request.urlopen(f"{base}/v2/", timeout=5) as resp:
            return resp.status
    wait_for(answers, lambda status: status == 200, timeout=timeouts.OPERATORS_START,
             description=f"{what} answering on {base}")
    return base


def _start_registry(platform: NodeHost, binaries: dict, layouts: list, progress) -> int:
    """The registry on a free loopback port, the node images pushed to it (the Ray image built
    first if the registry lacks it); returns its port."""
    from clusters.embedded.controlplane import free_ports

    port, = free_ports(1)
    storage = build.cache_root() / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    cfg = platform.run_dir / "registry.yml"
    cfg.write_text(registry.config_yaml(storage, port))
    rec = platform.start_process("registry", [str(binaries["registry"]), "serve", str(cfg)], env=env_for("registry"))
    base = _wait_answering(port, f"the node registry (log {rec.log})")
    for layout in layouts:
        t0 = time.monotonic()
        sent = registry.push(layout.path, layout.name, base)
        if sent:
            progress(f"pushed {layout.name} to the node registry: {sent / 2**20:.1f} MiB in "
                     f"{time.monotonic() - t0:.1f}s")
    rayimage.ensure(images_mod.cache_dir(), base, progress)
    return port


def _start_slow_path(platform: NodeHost, layouts: list, python_env: dict[str, str]) -> int:
    """The registry's slow path on a free loopback port, extending the shell image; returns its port."""
    import sys

    from clusters.embedded.controlplane import free_ports

    port, = free_ports(1)
    shell = next(layout for layout in layouts if layout.name.startswith("docker.io/library/busybox:"))
    rec = platform.start_process("slow-pull", [sys.executable, "-m", "clusters.embedded.nodes.slowpull",
                                               "--base", str(shell.path), "--port", str(port)], env=python_env)
    _wait_answering(port, f"the registry's slow path (log {rec.log})")
    return port


def start(platform: NodeHost, progress: Callable[[str], None], python_env: dict[str, str]) -> None:
    import sys

    from clusters.embedded.controlplane import write_kubeconfig

    binaries = platform.binaries()
    layouts = images_mod.ensure_images(images_mod.cache_dir(), Path(binaries["pause"]), Path(binaries["coredns"]),
                                       progress)
    nodes = nodes_of(platform)
    gpus = int(platform.profile.node_shape.get("nvidia.com/gpu", "0"))
    # kube-proxy's identity, bound by the API server's bootstrap policy to system:node-proxier.
    proxy_cert = platform.pki.ca.issue(platform.run_dir / "pki", "kube-proxy", "system:kube-proxy", client=True)
    reserved, short = system_reserved(platform.profile.node_shape, *machine_capacity())
    if short:
        progress(f"platform {platform.name}: the profile's node shape asks more than this machine has "
                 f"({'; '.join(short)}), so each kubelet node offers what the machine has")
    platform.register_cleanup("clusters.embedded.nodes.fabric:delete_outside", platform=platform.name)
    OutsideNet(platform.name).create()
    for node in nodes:
        # Registered after the pod network's teardown, so each runs before it: nodes go before the router.
        platform.register_cleanup("clusters.embedded.nodes.node:teardown", platform=platform.name,
                                  name=node.name, index=node.index, node_dir=str(node.dir))
        node.net.create()
        certs = platform.issue_node_certs(node.name, [node.net.ip])
        node.dir.mkdir(parents=True, exist_ok=True)
        write_kubeconfig(node.dir / "kubelet.kubeconfig", f"https://127.0.0.1:{relay.API_SERVER_PORT}",
                         platform.ca_file, certs.client, f"system:node:{node.name}")
        proxy_kubeconfig = write_kubeconfig(node.dir / "kube-proxy.kubeconfig",
                                            f"https://127.0.0.1:{relay.API_SERVER_PORT}", platform.ca_file,
                                            proxy_cert, "system:kube-proxy")
        node.prepare(ca_file=platform.ca_file, proxy_kubeconfig=proxy_kubeconfig,
                     serving_cert=certs.serving.cert, serving_key=certs.serving.key, reserved=reserved)

    registry_port = _start_registry(platform, binaries, layouts, progress)
    slow_port = _start_slow_path(platform, layouts, python_env)
    ready = platform.run_dir / "relay.ready"
    api_port = int(platform.api_server_url.rsplit(":", 1)[1])
    platform.start_process("relay", [sys.executable, "-m", "clusters.embedded.nodes.relay", "--ready", str(ready),
                                     "--forward", f"{relay.API_SERVER_PORT}={api_port}",
                                     "--forward", f"{relay.REGISTRY_PORT}={registry_port}",
                                     "--forward", f"{relay.SLOW_PULL_PORT}={slow_port}",
                                     # the API server's advertised address, for pods (CoreDNS)
                                     "--expose", f"{nodes[0].net.router}={ROUTER_IP}:{api_port}={api_port}",
                                     *(a for n in nodes for a in ("--netns", n.net.netns))], env=python_env)
    wait_for(ready.exists, timeout=timeouts.OPERATORS_START,
             description=f"the API server's and registries' listeners in the node namespaces of {platform.name}")
    # The StorageClasses' provisioner (provisioner.py).
    platform.start_process("provisioner", [
        sys.executable, "-m", "clusters.embedded.nodes.provisioner", "--kubeconfig", str(platform.kubeconfig),
        "--root", str(platform.run_dir / "pvc"), *(a for n in nodes for a in ("--node-var-lib", str(n.dir / "var-lib")))],
        env=python_env)

    for node in nodes:
        rec = platform.start_process(f"containerd-{node.index}", node.containerd_argv(),
                                     env=env_for("containerd"), exec_argvs=node.containerd_exec_argvs())
        wait_for(lambda: node.ctr(rec.pid, "version", timeout=10), lambda r: r.returncode == 0,
                 timeout=timeouts.OPERATORS_START,
                 description=f"containerd of {node.name} answering on its socket (log {rec.log})")
        # In process_names' order: the OOM group watches before any container starts.
        in_node = [("oom-group", node.oom_group_argv(rec.pid, sys.executable), python_env),
                   ("kubelet", node.kubelet_argv(rec.pid), env_for("kubelet")),
                   ("kube-proxy", node.kube_proxy_argv(rec.pid), env_for("kube-proxy"))]
        if gpus:
            in_node.append(("fakegpu", node.gpu_plugin_argv(rec.pid, gpus), env_for("fakegpu")))
        for kind, argv, env in in_node:
            platform.start_process(f"{kind}-{node.index}", argv, env=env, exec_argvs=in_node_exec_argvs(argv))
    progress(f"platform {platform.name}: {len(nodes)} kubelet nodes started (containerd, runc); waiting for Ready")


def containerd_pids(platform: NodeHost) -> dict[str, int]:
    """``{node name: PID of its containerd}``."""
    pids = {rec.name: rec.pid for rec in platform.supervisor.records()}
    return {node.name: pids[f"containerd-{node.index}"] for node in nodes_of(platform)}


def share_image_layers(platform: NodeHost, only: str | None = None) -> sharedlayers.Shared:
    """The image layers that several nodes unpacked, held once on the machine (``sharedlayers.py``): every
    later node's, or node ``only``'s alone."""
    return sharedlayers.share(nodes_of(platform), containerd_pids(platform), only=only)
