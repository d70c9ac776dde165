"""The pod network's router: one namespace that every node (and the outside) links to.

Layout, all inside namespaces this package and ``nodes/fabric.py`` create
(nothing in the machine's root namespace, so no pod packet can leave the
machine)::

    router netns rayproof-<platform>-net
      rk<i> (veth to node i, proxy_arp)   route 198.18.255.<10+i>/32 dev rk<i>
                                          route 198.18.<200+i>.0/24 via 198.18.255.<10+i>   (nodes/fabric.py)
      lo: 198.18.0.1 (the router, the API server's address for pods), 169.254.1.1 (gateway)
      unreachable 198.18.0.0/16, local 198.19.0.0/16
      ip_forward=1; iptables filter FORWARD -> RAYPROOF-FORWARD (NetworkPolicy, policy.py)

Every pod packet leaves its node for the router (``nodes/fabric.py``), so the
router is the one place where the NetworkPolicy chains (:mod:`.policy`) see
the real source and destination of every connection. Service addresses are
translated in each node by kube-proxy, never here: the router holds no nat
rule. Several processes use one network: the platform's controller programs
the rules, the node layer links nodes to the router. They share it through
names (namespaces are found by name) and ``state_dir`` (a lock for creating
the router), so either may start first and either may restart.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import re
import threading
from pathlib import Path
from typing import Iterator

from clusters.embedded.podnet import _host
from clusters.embedded.podnet import policy as _policy
from clusters.embedded.podnet.iptables import PREFIX, Table, render

log = logging.getLogger(__name__)

POD_CIDR = "198.18.0.0/16"  # the nodes' addresses and their pod ranges (nodes/fabric.py)
SERVICE_CIDR = "198.19.0.0/16"  # the API server's --service-cluster-ip-range
ROUTER_IP = "198.18.0.1"
# The kube-dns Service's cluster IP: kubelet's clusterDNS, CoreDNS's pods behind it (nodes/dns.py).
DNS_IP = "198.19.0.10"
DOMAIN = "cluster.local"  # kubelet's clusterDomain
GATEWAY = "169.254.1.1"

_PLATFORM_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class PodNetwork:
    """One platform's pod network.  ``open()`` makes (or finds) the router; ``close()`` removes everything."""

    def __init__(self, platform: str, state_dir: str | Path):
        if not _PLATFORM_RE.match(platform):
            raise ValueError(f"platform name {platform!r} must be 1-40 lowercase letters, digits or '-' "
                             "(it becomes part of network namespace names)")
        self.platform = platform
        self.state_dir = Path(state_dir)
        self.prefix = f"rayproof-{platform}-"
        self.router = f"{self.prefix}net"
        self._apply_lock = threading.Lock()

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
                           # every node's veth, created later, inherits proxy_arp from "default"
                           ("net.ipv4.conf.default.proxy_arp", "1"),
                           # "No route to host" for an address no node holds must
                           # come every time, not once a second per source.
                           ("net.ipv4.icmp_ratelimit", "0"),
                           # A packet between two pods of one node leaves by the interface
                           # it came in on; an ICMP redirect to the node would be wrong
                           # (and uses up its budget of ICMP errors).
                           ("net.ipv4.conf.all.send_redirects", "0"),
                           ("net.ipv4.conf.default.send_redirects", "0")):
            _host.sysctl(r, key, value)
        batch = "\n".join([
            f"address add {ROUTER_IP}/32 dev lo",
            f"address add {GATEWAY}/32 dev lo",
            # An address of the pod range that no node holds fails at once ("No route to host").
            f"route add unreachable {POD_CIDR}",
            # A Service address that kube-proxy in the sender's node left
            # untranslated (no Service has it) is delivered to the router
            # itself, where nothing listens: "Connection refused" at once,
            # rather than a wait (an unreachable route would answer with an
            # ICMP error, which the kernel rate-limits per source).
            f"route add local {SERVICE_CIDR} dev lo",
        ]) + "\n"
        _host.run(["ip", "-n", r, "-batch", "-"], input=batch)
        filt = _policy.compile_policies([], [], [])
        body = render(filt).splitlines()
        body[-1:-1] = [f"-A {chain} {rule}" for t, chain, rule in _policy.HOOKS if t == filt.name]
        _host.iptables_restore(r, "\n".join(body) + "\n")

    # -- rules -------------------------------------------------------------------------

    def apply_table(self, table: Table) -> None:
        """Make the router's ``RAYPROOF-*`` chains of ``table.name`` equal ``table``, in one commit."""
        with self._apply_lock:
            existing = _host.chains_in(_host.iptables_save(self.router, table.name), PREFIX)
            _host.iptables_restore(self.router, render(table, existing))

    def ruleset(self) -> dict[str, str]:
        """``iptables-save`` of the router's nat and filter tables: evidence for a failing test."""
        return {t: _host.iptables_save(self.router, t) for t in ("nat", "filter")}

    # -- teardown ----------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """Every namespace of this network that exists now (the router, and
        the nodes' and outside namespaces it routes; and the pod namespaces,
        ``p<10 hex digits>``, of a platform the retired node agent ran, so
        that an older checkout's platform still comes down): named exactly as
        this platform names them, so platform ``a`` never takes ``a-2``'s
        (``rayproof-a-2-net`` starts with ``rayproof-a-`` too)."""
        own = re.compile(rf"{re.escape(self.prefix)}(net|out|p[0-9a-f]{{10}}|k[0-9]+)")
        return [n for n in _host.list_netns(self.prefix) if own.fullmatch(n)]

    def close(self) -> None:
        """Delete every namespace of the network and the router (its chains go with it).

        Safe to repeat.  Processes left in a node's namespace are not killed
        here (the node layer's teardown kills them first); their namespaces
        are unmounted and so unreachable.
        """
        errors = []
        with self._locked():
            for ns in self.namespaces():
                if ns == self.router:
                    continue
                left = _host.netns_pids(ns)
                if left:
                    log.warning("namespace %s still holds processes %s at close", ns, left)
                try:
                    _host.delete_netns(ns)
                except _host.CommandFailed as exc:
                    errors.append(str(exc))
            try:
                _host.delete_netns(self.router)
            except _host.CommandFailed as exc:
                errors.append(str(exc))
            for name in ("ipam.json", "router.ready"):  # ipam.json: the retired node agent's pod addresses
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
