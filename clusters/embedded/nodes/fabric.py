"""The real nodes' network: one network namespace per node, routed through the pod network's router.

```
node netns rayproof-<platform>-k<i>                       router netns rayproof-<platform>-net
  eth0 198.18.255.<10+i>/32 ── veth ───────────────────── rk<i> (proxy_arp)
  default via 169.254.1.1 (onlink)                          route 198.18.255.<10+i>/32 dev rk<i>
  pods: 198.18.<200+i>.0/24 (CNI ptp + host-local)          route 198.18.<200+i>.0/24 via 198.18.255.<10+i>
  rule 100: iif eth0           -> main  (to the node's pods)
  rule 140: from the node's pod gateway -> main  (kubelet's probes, straight to its pods)
  rule 150: from pods to node  -> main  (probes' replies, the node's own addresses)
  rule 200: from pods          -> table 100: default via the router

outside netns rayproof-<platform>-out  (a client beside the nodes, not in the cluster)
  eth0 198.18.255.250/32 ── veth ──────────────────────── ro (proxy_arp)
  default via 169.254.1.1 (onlink)                          route 198.18.255.250/32 dev ro
```

Every packet a pod sends to another pod (a Service's or DNS's endpoint too,
once kube-proxy in its node has translated the address) leaves its node for
the router, same-node peers included, so the router's NetworkPolicy chains
(``podnet``), where they run, judge all pod traffic; the API server's egress (logs, exec, port-forward, its service
proxy) reaches kubelets and pods through the router too. Nothing is added to
the machine's root namespace.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from clusters.embedded.podnet import _host
from clusters.embedded.podnet.network import GATEWAY

NODE_ADDRESS_BASE = ipaddress.ip_address("198.18.255.10")
POD_CIDR_BASE = 200  # node i's pods: 198.18.<200+i>.0/24
MAX_NODES = 16
POD_ROUTE_TABLE = 100


def router_netns(platform: str) -> str:
    """The pod network's router namespace of ``platform`` (podnet), which every node and the outside link to."""
    return f"rayproof-{platform}-net"


@dataclass(frozen=True)
class NodeNet:
    platform: str
    index: int  # 1-based

    @property
    def netns(self) -> str:
        return f"rayproof-{self.platform}-k{self.index}"

    @property
    def router(self) -> str:
        return router_netns(self.platform)

    @property
    def router_ifname(self) -> str:
        return f"rk{self.index}"

    @property
    def ip(self) -> str:
        return str(NODE_ADDRESS_BASE + self.index)

    @property
    def pod_cidr(self) -> str:
        return f"198.18.{POD_CIDR_BASE + self.index}.0/24"

    @property
    def pod_gateway(self) -> str:
        return f"198.18.{POD_CIDR_BASE + self.index}.1"

    def create(self) -> None:
        """Make (or remake) the node's namespace and its links; the router must exist."""
        if not 1 <= self.index <= MAX_NODES:
            raise ValueError(f"node index {self.index} outside 1..{MAX_NODES}")
        if not _host.netns_exists(self.router):
            raise RuntimeError(f"router namespace {self.router} is missing: start the pod network first")
        self.delete()
        _host.add_netns(self.netns)
        for key, value in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                           ("net.ipv4.conf.default.rp_filter", "0")):
            _host.sysctl(self.netns, key, value)
        _host.run(["ip", "-n", self.router, "link", "add", self.router_ifname, "type", "veth",
                   "peer", "name", "eth0", "netns", self.netns])
        pods = self.pod_cidr
        _host.run(["ip", "-n", self.netns, "-batch", "-"], input="\n".join([
            f"address add {self.ip}/32 dev eth0",
            "link set eth0 up",
            f"route add {GATEWAY} dev eth0 scope link",
            f"route add default via {GATEWAY} dev eth0",
            f"route add default via {GATEWAY} dev eth0 onlink table {POD_ROUTE_TABLE}",
            "rule add iif eth0 lookup main pref 100",
            # kubelet's TCP and HTTP probes leave from the gateway address, inside the pod range: without
            # this rule rule 200 sent them to the router, which dropped them (the Redis pod never got Ready).
            f"rule add from {self.pod_gateway}/32 lookup main pref 140",
            f"rule add from {pods} to {self.ip}/32 lookup main pref 150",
            f"rule add from {pods} to {self.pod_gateway}/32 lookup main pref 150",
            f"rule add from {pods} lookup {POD_ROUTE_TABLE} pref 200",
        ]) + "\n")
        _host.run(["ip", "-n", self.router, "-batch", "-"], input="\n".join([
            f"link set {self.router_ifname} up",
            f"route replace {self.ip}/32 dev {self.router_ifname} scope link",
            f"route replace {pods} via {self.ip} dev {self.router_ifname}",
        ]) + "\n")

    def delete(self) -> None:
        """Remove the namespace (its veth, and so the router's routes, go with it); safe to repeat."""
        if _host.netns_exists(self.router):
            _host.run(["ip", "-n", self.router, "link", "del", self.router_ifname], check=False)
        _host.delete_netns(self.netns)

    def cni_config(self) -> dict:
        """The CNI network list containerd gives every pod of this node."""
        return {
            "cniVersion": "1.0.0",
            "name": "rayproof",
            "plugins": [
                {"type": "ptp", "mtu": 1500,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr,
                                                             "gateway": self.pod_gateway}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }


OUTSIDE_ADDRESS = "198.18.255.250"


@dataclass(frozen=True)
class OutsideNet:
    """Where "outside the cluster" is on this platform: a namespace beside
    the nodes, routed to their addresses through the router and to nothing
    else (the router has no way off the machine). SEC-1 probes the addresses
    the cluster reports from here, never from the machine's own namespace,
    whose packets to a non-loopback address would leave the machine."""

    platform: str

    @property
    def netns(self) -> str:
        return f"rayproof-{self.platform}-out"

    @property
    def router(self) -> str:
        return router_netns(self.platform)

    def create(self) -> None:
        """Make (or remake) the namespace and its link to the router; the router must exist."""
        if not _host.netns_exists(self.router):
            raise RuntimeError(f"router namespace {self.router} is missing: start the pod network first")
        self.delete()
        _host.add_netns(self.netns)
        _host.run(["ip", "-n", self.router, "link", "add", "ro", "type", "veth", "peer", "name", "eth0",
                   "netns", self.netns])
        _host.run(["ip", "-n", self.netns, "-batch", "-"], input="\n".join([
            f"address add {OUTSIDE_ADDRESS}/32 dev eth0", "link set eth0 up", "link set lo up",
            f"route add {GATEWAY} dev eth0 scope link", f"route add default via {GATEWAY} dev eth0",
        ]) + "\n")
        _host.run(["ip", "-n", self.router, "-batch", "-"], input="\n".join([
            "link set ro up", f"route replace {OUTSIDE_ADDRESS}/32 dev ro scope link",
        ]) + "\n")
        _host.sysctl(self.router, "net.ipv4.conf.ro.proxy_arp", "1")

    def delete(self) -> None:
        """Remove the namespace (its veth and the router's route go with it); safe to repeat."""
        _host.delete_netns(self.netns)


def delete_outside(platform: str) -> None:
    """For ``EmbeddedPlatform.register_cleanup``: the platform's outside namespace is gone."""
    OutsideNet(platform).delete()
