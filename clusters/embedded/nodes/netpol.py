"""NetworkPolicy on the real nodes: kube-router's firewall, one per node in the node's namespaces.

kube-router runs with its firewall alone (``--run-firewall``; its router and
service proxy off: the CNI ``ptp`` plugin and kube-proxy do those), as its
``kube-router-firewall-daemonset.yaml`` runs it beside another CNI. Each one
watches Pods, Namespaces and NetworkPolicies and writes iptables chains and
ipsets in its node's network namespace for the pods of that node (the pods
whose ``status.hostIP`` is the node's address), so a pod's traffic is judged
where it leaves and where it enters its node: same-node peers (their packets
leave the node for the router and come back), DNS (CoreDNS pods, reached
through kube-proxy's DNAT), Services after DNAT, and the API server's traffic
to pods (it reaches them through the router) alike.

``--netpol-default-deny`` rejects a pod's traffic until its own chain is
written, so a new pod is isolated from its first packet. kube-router reads the
node's pod range for it from ``spec.podCIDRs``, which the platform sets at
registration to the range the node's CNI hands out (what
kube-controller-manager's ``--allocate-node-cidrs`` does on other clusters).
The same rule rejects what a force-deleted pod still sends: kube-router
forgets the pod when it leaves the API, before kubelet has killed it, so its
peers never see its connections close (two busybox pods showed it, README).
A platform on this engine has to survive that; the reference platform's
golden RayJob does, by a liveness probe on its submitter (TRN-2).

Connections conntrack already knows keep flowing after a new policy:
kube-router accepts ESTABLISHED traffic first, as Calico and Antrea do. The
reference platform cuts them (``network.policyCutsOpenConnections: true``),
so there the router's engine judges NetworkPolicy too, every packet a
connection's initiator sends through the router (``podnet run
--recheck-established``); with false or null kube-router judges alone
(``--no-network-policy``). ``platform.pod_network_flags`` decides.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from clusters.embedded.nodes.host import NodeHost
from clusters.embedded.nodes.layer import POLICY_ENGINE_KIND
from clusters.embedded.nodes.node import Node, env_for, in_node_exec_argvs
from clusters.embedded.podnet import _host
from core import timeouts
from core.waiting import wait_for

RBAC = Path(__file__).with_name("kube-router-rbac.yaml")
USER = "kube-router"  # the identity of its client certificate, bound to RBAC's ClusterRole
# The chain kube-router's firewall hooks into FORWARD, the chain ending it (its
# default deny), and the ipset of the pods whose chains it has written.
FORWARD_CHAIN = "KUBE-ROUTER-FORWARD"
TAIL_CHAIN = "KUBE-NWPLCY-TAIL"
LOCAL_PODS_IPSET = "kube-router-local-pods"


def grant(api_client: Any) -> None:
    """Apply the engine's ClusterRole and its binding to ``USER`` (``kube-router-rbac.yaml``)."""
    from kubernetes import utils

    for doc in yaml.safe_load_all(RBAC.read_text()):
        if doc:
            utils.create_from_dict(api_client, doc)


def set_pod_ranges(api_client: Any, nodes: Sequence[Node]) -> None:
    """Each node's ``spec.podCIDRs``: the range its CNI hands out (``fabric.NodeNet.pod_cidr``)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    for node in nodes:
        core.patch_node(node.name, {"spec": {"podCIDR": node.net.pod_cidr, "podCIDRs": [node.net.pod_cidr]}})


def in_force(node: Node) -> str:
    """What of kube-router's firewall is missing in the node's namespace ("" once its chain is
    hooked into FORWARD and its default deny rejects pods it has not written a chain for)."""
    rules = _host.iptables_save(node.net.netns, "filter").splitlines()
    if not any(r.startswith("-A FORWARD ") and r.endswith(f"-j {FORWARD_CHAIN}") for r in rules):
        return f"no jump to {FORWARD_CHAIN} in FORWARD"
    if not any(r.startswith(f"-A {TAIL_CHAIN} ") and LOCAL_PODS_IPSET in r for r in rules):
        return f"no default deny in {TAIL_CHAIN} (no rule matching ipset {LOCAL_PODS_IPSET})"
    return ""


def start(platform: NodeHost, nodes: Sequence[Node], progress: Callable[[str], None]) -> None:
    """Start one kube-router per node (the nodes are registered), and wait until each has
    written its chains."""
    from clusters.embedded.controlplane import write_kubeconfig
    from clusters.embedded.nodes.relay import API_SERVER_PORT

    api = platform.api_client()
    grant(api)
    set_pod_ranges(api, nodes)
    cert = platform.pki.ca.issue(platform.run_dir / "pki", "kube-router", USER, client=True)
    for node in nodes:
        write_kubeconfig(node.dir / "kube-router.kubeconfig", f"https://127.0.0.1:{API_SERVER_PORT}",
                         platform.ca_file, cert, USER)
        containerd = platform.supervisor.record(f"containerd-{node.index}")
        if containerd is None:
            raise RuntimeError(f"containerd of {node.name} is not recorded; the node layer did not start")
        argv = node.kube_router_argv(containerd.pid)
        rec = platform.start_process(f"{POLICY_ENGINE_KIND}-{node.index}", argv, env=env_for(POLICY_ENGINE_KIND),
                                     exec_argvs=in_node_exec_argvs(argv))
        wait_for(lambda: in_force(node), lambda missing: not missing, timeout=timeouts.OPERATORS_START,
                 description=f"kube-router's firewall in force in {node.name} (log {rec.log})")
    progress(f"platform {platform.name}: NetworkPolicy enforced by kube-router in each of {len(nodes)} nodes")
