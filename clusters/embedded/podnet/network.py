"""The routed (Calico-style) pod network: one router namespace, one namespace per pod.

Layout, all inside namespaces this module creates (nothing in the machine's
root namespace, so no pod packet can leave the machine)::

    pod netns rayproof-<platform>-p<id>          router netns rayproof-<platform>-net
      eth0  198.18.x.y/32  ── veth ──────────────  rp<id>  (proxy_arp=1)
                                                   route 198.18.x.y/32 dev rp<id>
      169.254.1.1 dev eth0 scope link              lo: 198.18.0.1 (router/SNAT), 198.19.0.10 (DNS),
      default via 169.254.1.1 dev eth0                 169.254.1.1 (gateway)
                                                   unreachable 198.18.0.0/16, local 198.19.0.0/16
                                                   ip_forward=1; iptables RAYPROOF-* chains

Each pod has a /32 and a default route to the link-local gateway, which the
router answers ARP for, as Calico does; so every pod-to-pod (and
pod-to-service) packet is routed through the router namespace, the single
place where service DNAT (:mod:`.services`) and NetworkPolicy
(:mod:`.policy`) happen.  Service addresses (198.19.0.0/16) need no route of
their own in the pod: the default route covers them.

Several processes may use one network: the node agent attaches and detaches
pods, the platform's controller programs rules and serves DNS.  They share it
through names (namespaces are found by name) and ``state_dir`` (the address
allocator and a lock for creating the router), so either may start first and
either may restart.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from clusters.embedded.podnet import _host
from clusters.embedded.podnet import policy as _policy
from clusters.embedded.podnet import services as _services
from clusters.embedded.podnet.dns import DnsServer, Zone, resolv_conf
from clusters.embedded.podnet.ipam import IPAM
from clusters.embedded.podnet.iptables import PREFIX, Table, render
from clusters.embedded.podnet.model import Endpoint, Namespace, Pod, Service

log = logging.getLogger(__name__)

POD_CIDR = "198.18.0.0/16"
SERVICE_CIDR = "198.19.0.0/16"
ROUTER_IP = "198.18.0.1"
DNS_IP = "198.19.0.10"
GATEWAY = "169.254.1.1"

_PLATFORM_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


def exec_prefix(netns: str) -> list[str]:
    """argv prefix that runs a command inside the pod (or router) namespace ``netns``."""
    return _host.netns_exec(netns)


def short_id(pod_key: str) -> str:
    """10 hex digits naming a pod's namespace and router-side interface (15-character limit)."""
    return hashlib.sha256(pod_key.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class PodAttachment:
    """What the node agent needs to run a pod's containers on the pod network."""

    pod_key: str
    netns: str  # run containers under exec_prefix(netns), or setns(/run/netns/<netns>)
    ip: str  # report as status.podIP
    host_ifname: str  # router-side veth (named after the pod)
    gateway: str = GATEWAY

    def exec_prefix(self) -> list[str]:
        return exec_prefix(self.netns)


class PodNetwork:
    """One platform's pod network.  ``open()`` makes (or finds) the router; ``close()`` removes everything."""

    def __init__(self, platform: str, state_dir: str | Path, *, dns_ip: str = DNS_IP):
        if not _PLATFORM_RE.match(platform):
            raise ValueError(f"platform name {platform!r} must be 1-40 lowercase letters, digits or '-' "
                             "(it becomes part of network namespace names)")
        self.platform = platform
        self.state_dir = Path(state_dir)
        self.dns_ip = dns_ip
        self.prefix = f"rayproof-{platform}-"
        self.router = f"{self.prefix}net"
        self.ipam = IPAM(self.state_dir, POD_CIDR, reserved=(ROUTER_IP,))
        self._apply_lock = threading.Lock()
        self._dns: DnsServer | None = None

    @classmethod
    def for_run_dir(cls, run_dir: str | Path, platform: str) -> "PodNetwork":
        """The network whose state lives in ``<run_dir>/podnet`` (the platform's run directory)."""
        return cls(platform, Path(run_dir) / "podnet")

    # -- router ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "network.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def open(self) -> "PodNetwork":
        """Create the router namespace unless another process already did; return self."""
        _host.check_available()
        with self._locked():
            if _host.netns_exists(self.router) and (self.state_dir / "router.ready").exists():
                return self
            self._make_router()
            (self.state_dir / "router.ready").write_text(self.router)
        return self

    def _make_router(self) -> None:
        r = self.router
        # A half-made router (process killed mid-way) is rebuilt from scratch.
        _host.delete_netns(r)
        _host.add_netns(r)
        for key, value in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                           ("net.ipv4.conf.default.rp_filter", "0"),
                           # every pod's veth, created later, inherits proxy_arp from "default"
                           ("net.ipv4.conf.default.proxy_arp", "1"),
                           # "No route to host" for a service without endpoints must
                           # come every time, not once a second per pod.
                           ("net.ipv4.icmp_ratelimit", "0"),
                           # A hairpin packet leaves by the interface it came in on; an
                           # ICMP redirect to the pod would be wrong (and uses up the
                           # per-pod budget of ICMP errors).
                           ("net.ipv4.conf.all.send_redirects", "0"),
                           ("net.ipv4.conf.default.send_redirects", "0")):
            _host.sysctl(r, key, value)
        batch = "\n".join([
            f"address add {ROUTER_IP}/32 dev lo",
            f"address add {self.dns_ip}/32 dev lo",
            f"address add {GATEWAY}/32 dev lo",
            # An unassigned pod address fails at once ("No route to host").
            f"route add unreachable {POD_CIDR}",
            # A service address that no DNAT rule rewrote (no ready endpoint)
            # is delivered to the router itself, where nothing listens: the
            # client gets "Connection refused" at once, as from kube-proxy's
            # REJECT.  (An unreachable route would do it by an ICMP error,
            # which the kernel rate-limits per source.)
            f"route add local {SERVICE_CIDR} dev lo",
        ]) + "\n"
        _host.run(["ip", "-n", r, "-batch", "-"], input=batch)
        nat = _services.compile_services([], {}, snat_ip=ROUTER_IP)
        filt = _policy.compile_policies([], [], [])
        hooks = [*_services.HOOKS, *_policy.HOOKS]
        text = ""
        for table in (nat, filt):
            body = render(table).splitlines()
            body[-1:-1] = [f"-A {chain} {rule}" for t, chain, rule in hooks if t == table.name]
            text += "\n".join(body) + "\n"
        _host.iptables_restore(r, text)

    # -- pods --------------------------------------------------------------------------

    def _names(self, pod_key: str) -> tuple[str, str]:
        sid = short_id(pod_key)
        return f"{self.prefix}p{sid}", f"rp{sid}"

    def attach(self, pod_key: str) -> PodAttachment:
        """Give ``pod_key`` (e.g. ``<namespace>/<name>/<uid>``) a namespace and an address; idempotent.

        Attaching a key that is already attached returns the same namespace
        and address, repairing whatever part is missing (after an agent
        crash) without disturbing processes already in the namespace.
        """
        if not _host.netns_exists(self.router):
            self.open()
        netns, host_if = self._names(pod_key)
        ip = self.ipam.allocate(pod_key)
        created = False
        try:
            created = _host.add_netns(netns)
            if not _link_exists(self.router, host_if):
                _host.run(["ip", "-n", netns, "link", "del", "eth0"], check=False)  # no dangling half
                _host.run(["ip", "-n", self.router, "link", "add", host_if, "type", "veth",
                           "peer", "name", "eth0", "netns", netns])
            _host.run(["ip", "-n", netns, "-batch", "-"], input="\n".join([
                f"address replace {ip}/32 dev eth0",
                "link set eth0 up",
                f"route replace {GATEWAY} dev eth0 scope link",
                f"route replace default via {GATEWAY} dev eth0",
            ]) + "\n")
            _host.run(["ip", "-n", self.router, "-batch", "-"], input="\n".join([
                f"link set {host_if} up",
                f"route replace {ip}/32 dev {host_if} scope link",
            ]) + "\n")
        except Exception:
            if created:  # leave nothing half-made for a pod that never started
                self.detach(pod_key)
            raise
        return PodAttachment(pod_key, netns, ip, host_if)

    def detach(self, pod_key: str) -> None:
        """Remove the pod's interface, route, namespace and address; safe to repeat.

        Processes still inside the namespace keep it alive but cut off; the
        node agent stops them first.
        """
        netns, host_if = self._names(pod_key)
        if _host.netns_exists(self.router):
            _host.run(["ip", "-n", self.router, "link", "del", host_if], check=False)  # route goes with it
        _host.delete_netns(netns)
        self.ipam.release(pod_key)

    def attachment(self, pod_key: str) -> PodAttachment | None:
        ip = self.ipam.lookup(pod_key)
        if ip is None:
            return None
        netns, host_if = self._names(pod_key)
        return PodAttachment(pod_key, netns, ip, host_if)

    def attachments(self) -> dict[str, PodAttachment]:
        """Every attached pod, from the shared allocation file (so any process sees all of them)."""
        out = {}
        for key, ip in self.ipam.allocations().items():
            netns, host_if = self._names(key)
            out[key] = PodAttachment(key, netns, ip, host_if)
        return out

    def resolv_conf(self, namespace: str) -> str:
        """``/etc/resolv.conf`` text for a pod of Kubernetes namespace ``namespace``."""
        return resolv_conf(namespace, self.dns_ip)

    # -- rules -------------------------------------------------------------------------

    def apply_table(self, table: Table) -> None:
        """Make the router's ``RAYPROOF-*`` chains of ``table.name`` equal ``table``, in one commit."""
        with self._apply_lock:
            existing = _host.chains_in(_host.iptables_save(self.router, table.name), PREFIX)
            _host.iptables_restore(self.router, render(table, existing))

    def apply_services(self, services: Iterable[Service], endpoints: Mapping[tuple[str, str], list[Endpoint]]) -> None:
        """Make the router's service DNAT rules match ``services`` (one atomic nat-table commit)."""
        self.apply_table(_services.compile_services(list(services), endpoints, snat_ip=ROUTER_IP))

    def apply_policies(self, pods: Iterable[Pod], namespaces: Iterable[Namespace],
                       policies: Sequence[Mapping[str, Any]], *, recheck_established: bool = False) -> None:
        """Make the router's FORWARD filtering enforce ``policies`` (one atomic filter-table commit)."""
        self.apply_table(_policy.compile_policies(pods, namespaces, policies, recheck_established=recheck_established))

    def ruleset(self) -> dict[str, str]:
        """``iptables-save`` of the router's nat and filter tables: evidence for a failing test."""
        return {t: _host.iptables_save(self.router, t) for t in ("nat", "filter")}

    # -- DNS ---------------------------------------------------------------------------

    def start_dns(self, zone: Zone | None = None) -> DnsServer:
        """Serve cluster DNS on ``dns_ip``:53 inside the router, as threads of this process."""
        if self._dns is not None:
            return self._dns
        server = DnsServer(self.dns_ip, 53, zone)
        sockets = _host.in_netns(self.router, server.make_sockets)
        self._dns = server.start(sockets)
        return server

    @property
    def dns(self) -> DnsServer | None:
        return self._dns

    def stop_dns(self) -> None:
        if self._dns is not None:
            self._dns.stop()
            self._dns = None

    # -- teardown ----------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """Every namespace of this network that exists now (router, pods, and
        the real nodes' and outside namespaces it routes): named exactly as
        this platform names them, so platform ``a`` never takes ``a-2``'s
        (``rayproof-a-2-net`` starts with ``rayproof-a-`` too)."""
        own = re.compile(rf"{re.escape(self.prefix)}(net|out|p[0-9a-f]{{10}}|k[0-9]+)")
        return [n for n in _host.list_netns(self.prefix) if own.fullmatch(n)]

    def close(self) -> None:
        """Stop DNS, delete every pod namespace and the router (its chains go with it), forget allocations.

        Safe to repeat.  Processes the node agent left in pod namespaces are
        not killed here (they are not this network's); their namespaces are
        unmounted and so unreachable.
        """
        self.stop_dns()
        errors = []
        with self._locked():
            for ns in self.namespaces():
                if ns == self.router:
                    continue
                left = _host.netns_pids(ns)
                if left:
                    log.warning("pod namespace %s still holds processes %s at close", ns, left)
                try:
                    _host.delete_netns(ns)
                except _host.CommandFailed as exc:
                    errors.append(str(exc))
            try:
                _host.delete_netns(self.router)
            except _host.CommandFailed as exc:
                errors.append(str(exc))
            for name in ("ipam.json", "router.ready"):
                (self.state_dir / name).unlink(missing_ok=True)
        if errors:
            raise RuntimeError("pod network teardown left namespaces behind: " + "; ".join(errors))

    def __enter__(self) -> "PodNetwork":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def teardown(platform: str, state_dir: str) -> None:
    """Remove platform ``platform``'s whole pod network, from any process; idempotent.

    JSON-friendly arguments, for ``EmbeddedPlatform.register_cleanup(
    "clusters.embedded.podnet.network:teardown", platform=…, state_dir=…)``:
    it runs after the platform's processes (controller included) are stopped.
    """
    PodNetwork(platform, state_dir).close()


def _link_exists(netns: str, ifname: str) -> bool:
    return _host.run(["ip", "-n", netns, "link", "show", "dev", ifname], check=False).returncode == 0
