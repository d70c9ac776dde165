"""The embedded platform's pod network: compilers from literals, then the real thing in network namespaces.

The first half needs nothing (pure functions, a DNS server on loopback).  The
second half builds real router and pod namespaces (root, iproute2, iptables)
and drives them through :class:`PodNetworkController` fed by hand, the same
path the API watch feeds, with traffic between in-process sockets that were
created inside the pod namespaces.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.parse
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from clusters.embedded.podnet import (
    DNS_IP,
    POD_NETWORK_SYNC,
    ClusterState,
    DnsServer,
    Namespace,
    Pod,
    PodAttachment,
    PodNetworkController,
    PolicyError,
    Service,
    ServicePort,
    _host,
    build_zone,
    check_available,
    cluster_proxy_socket,
    compile_policies,
    compile_services,
    dns,
    endpoints_from_slices,
)
from clusters.embedded.podnet.ipam import IPAM
from clusters.embedded.podnet.iptables import render
from core import timeouts
from core.waiting import wait_for

# Socket timeout of one probe connection.  A connection the policy drops must
# fail by timing out (DROP, not REJECT); one that is allowed connects in
# milliseconds on loopback-speed veths, so one second separates them clearly.
CONNECT_TIMEOUT_S = 1.0


def _uncomment(rules: list[str]) -> list[str]:
    """Rules without their ``-m comment`` part, to compare against short literals."""
    out = []
    for r in rules:
        if "-m comment" in r:
            head, _, tail = r.partition('-m comment --comment "')
            r = head + tail.partition('" ')[2]
        out.append(" ".join(r.split()))
    return out


# --- NetworkPolicy compiler (pure) -------------------------------------------------------

A = Pod("default", "a", "198.18.0.2", {"app": "a"})
B = Pod("default", "b", "198.18.0.3", {"app": "b"}, {"http": (8080, "TCP")})
C = Pod("other", "c", "198.18.0.4", {"app": "c"}, {"http": (9090, "TCP")})
NOIP = Pod("default", "pending", None, {"app": "b"})
NAMESPACES = [Namespace.from_api({"metadata": {"name": "default"}}),
              Namespace.from_api({"metadata": {"name": "other", "labels": {"team": "x"}}})]


def _pol(name: str, spec: dict, namespace: str = "default") -> dict:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": spec}


def _compile(*policies: dict, recheck: bool = False) -> dict[str, list[str]]:
    table = compile_policies([A, B, C, NOIP], NAMESPACES, list(policies), recheck_established=recheck)
    return {chain: _uncomment(rules) for chain, rules in table.chains.items()}


def _pod_chain(chains: dict[str, list[str]], kind: str) -> list[str]:
    """The single per-pod chain of ``kind`` (I or E)."""
    found = [c for c in chains if c.startswith(f"RAYPROOF-{kind}-")]
    assert len(found) == 1, f"expected one RAYPROOF-{kind}-* chain, got {found}"
    return chains[found[0]]


def test_no_policy_isolates_nothing():
    chains = _compile()
    assert chains["RAYPROOF-FORWARD"] == [
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        "-m conntrack --ctstate INVALID -j DROP",
        "-j RAYPROOF-EGRESS",
        "-j RAYPROOF-INGRESS",
    ]
    assert chains["RAYPROOF-INGRESS"] == [] and chains["RAYPROOF-EGRESS"] == []


def test_ingress_from_pod_selector_on_one_port():
    chains = _compile(_pol("p", {"podSelector": {"matchLabels": {"app": "b"}},
                                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}],
                                              "ports": [{"port": 7000}]}]}))
    chain = [c for c in chains if c.startswith("RAYPROOF-I-")][0]
    # B is selected; the pending pod with the same label has no IP and is left out.
    assert chains["RAYPROOF-INGRESS"] == [f"-d 198.18.0.3/32 -j {chain}"]
    assert chains[chain] == ["-s 198.18.0.2/32 -p tcp -m tcp --dport 7000 -j RETURN", "-j DROP"]
    assert chains["RAYPROOF-EGRESS"] == [], "policyTypes defaults to Ingress only without an egress section"


def test_empty_ingress_denies_all_and_empty_rule_allows_all():
    deny = _compile(_pol("deny", {"podSelector": {}, "policyTypes": ["Ingress"]}))
    assert len(deny["RAYPROOF-INGRESS"]) == 2, "both pods of namespace default with an IP are isolated"
    assert all(deny[c] == ["-j DROP"] for c in deny if c.startswith("RAYPROOF-I-"))
    allow = _compile(_pol("deny", {"podSelector": {}, "policyTypes": ["Ingress"]}),
                     _pol("allow", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [{}]}))
    b_chain = [r.split()[-1] for r in allow["RAYPROOF-INGRESS"] if "198.18.0.3/32" in r][0]
    assert allow[b_chain] == ["-j RETURN", "-j DROP"], "policies are additive: the union allows everything"


def test_an_engine_on_some_nodes_guards_only_the_pods_there():
    on = Pod("default", "on", "198.18.0.5", {"app": "b"}, node="n1")
    off = Pod("default", "off", "198.18.0.6", {"app": "b"}, node="n2")
    deny = _pol("deny", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]})
    table = compile_policies([A, on, off], NAMESPACES, [deny], guarded_nodes=frozenset({"n1"}))
    guarded = _uncomment(table.chains["RAYPROOF-INGRESS"])
    assert len(guarded) == 1 and guarded[0].startswith("-d 198.18.0.5/32"), guarded
    assert Pod.from_api({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}, "status": {}}).node == "n1"


def test_host_ports_map_to_their_pods_first_come_first_served():
    from clusters.embedded.podnet.nodeports import compile_host_ports

    def pod(name: str, ip: str | None, ports: list) -> Pod:
        return Pod.from_api({"metadata": {"namespace": "t", "name": name}, "spec": {"containers": [{"ports": ports}]},
                             "status": {"podIP": ip, "phase": "Running"}})

    head = pod("a-head", "198.18.0.7", [{"containerPort": 8265, "hostPort": 8265}, {"containerPort": 6379}])
    other = pod("b-head", "198.18.0.8", [{"containerPort": 8265, "hostPort": 8265},
                                         {"containerPort": 53, "hostPort": 5353, "protocol": "UDP"}])
    pending = pod("c", None, [{"containerPort": 10001, "hostPort": 10001}])
    ports = compile_host_ports([other, head, pending])
    assert list(ports) == [8265] and (ports[8265].cluster_ip, ports[8265].port) == ("198.18.0.7", 8265)


def test_namespace_selector_alone_and_with_pod_selector():
    chains = _compile(_pol("p", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"team": "x"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
         "podSelector": {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["b"]}]}},
    ]}]}))
    assert _pod_chain(chains, "I") == ["-s 198.18.0.4/32 -j RETURN", "-s 198.18.0.2/32 -j RETURN", "-j DROP"]


def test_ip_block_with_except_uses_a_helper_chain():
    chains = _compile(_pol("p", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [{"from": [
        {"ipBlock": {"cidr": "198.18.0.0/16", "except": ["198.18.0.2/32"]}}], "ports": [{"port": 80}]}]}))
    helper = [c for c in chains if c.startswith("RAYPROOF-X-")][0]
    assert _pod_chain(chains, "I") == [f"-s 198.18.0.0/16 -j {helper}", "-m mark --mark 0x10000/0x10000 -j RETURN",
                                       "-j DROP"]
    assert chains[helper] == ["-j MARK --set-xmark 0x0/0x10000", "-s 198.18.0.2/32 -j RETURN",
                              "-p tcp -m tcp --dport 80 -j MARK --set-xmark 0x10000/0x10000"]


def test_port_range_protocol_and_named_ports():
    chains = _compile(_pol("p", {"podSelector": {"matchLabels": {"app": "b"}}, "ingress": [{"ports": [
        {"port": 7000, "endPort": 7010}, {"protocol": "UDP", "port": 53}, {"protocol": "UDP"},
        {"port": "http"}, {"port": "missing"}]}]}))
    assert _pod_chain(chains, "I") == [
        "-p tcp -m tcp --dport 7000:7010 -j RETURN",
        "-p udp -m udp --dport 53 -j RETURN",
        "-p udp -j RETURN",
        "-p tcp -m tcp --dport 8080 -j RETURN",  # B's container port named http
        "-j DROP",
    ]


def test_egress_named_port_resolves_on_each_destination_pod():
    chains = _compile(_pol("p", {"podSelector": {"matchLabels": {"app": "a"}},
                                 "egress": [{"ports": [{"port": "http"}]}]}))
    assert _pod_chain(chains, "E") == ["-d 198.18.0.3/32 -p tcp -m tcp --dport 8080 -j RETURN",
                                       "-d 198.18.0.4/32 -p tcp -m tcp --dport 9090 -j RETURN", "-j DROP"]
    assert chains["RAYPROOF-EGRESS"][0].startswith("-s 198.18.0.2/32 ")


def test_default_policy_types_with_egress_section_isolate_both_directions():
    chains = _compile(_pol("p", {"podSelector": {"matchLabels": {"app": "a"}}, "egress": [{}]}))
    assert _pod_chain(chains, "I") == ["-j DROP"]
    assert _pod_chain(chains, "E") == ["-j RETURN", "-j DROP"]


def test_recheck_established_judges_every_original_direction_packet():
    chains = _compile(recheck=True)
    assert chains["RAYPROOF-FORWARD"][:2] == ["-m conntrack --ctstate RELATED -j ACCEPT",
                                              "-m conntrack --ctstate ESTABLISHED --ctdir REPLY -j ACCEPT"]


def test_invalid_policies_raise():
    with pytest.raises(PolicyError, match="endPort needs a numeric port"):
        _compile(_pol("p", {"podSelector": {}, "ingress": [{"ports": [{"port": "http", "endPort": 9000}]}]}))
    with pytest.raises(PolicyError, match="operator"):
        _compile(_pol("p", {"podSelector": {"matchExpressions": [{"key": "a", "operator": "Gt"}]}}))


def test_render_declares_wanted_chains_and_deletes_stale_ones():
    table = compile_policies([A, B], NAMESPACES, [])
    text = render(table, existing={"RAYPROOF-FORWARD", "RAYPROOF-I-OLD"})
    lines = text.splitlines()
    assert lines[0] == "*filter" and lines[-1] == "COMMIT"
    assert ":RAYPROOF-I-OLD - [0:0]" in lines and lines[-2] == "-X RAYPROOF-I-OLD"
    assert all(len(c) <= 28 for c in table.chains)


# --- services compiler and DNS zone (pure) ----------------------------------------------

SLICES = [{
    "metadata": {"namespace": "default", "name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
    "addressType": "IPv4",
    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    "endpoints": [{"addresses": ["198.18.0.3"], "conditions": {"ready": True}, "hostname": "b"},
                  {"addresses": ["198.18.0.2"]},  # ready absent means ready
                  {"addresses": ["198.18.0.9"], "conditions": {"ready": False}}],
}]


def test_services_dnat_spreads_over_ready_endpoints_only():
    web = Service("default", "web", "198.19.0.20", (ServicePort("http", 80, "TCP", "http"),))
    table = compile_services([web, Service("default", "hl", None, (ServicePort("", 80),), headless=True)],
                             endpoints_from_slices(SLICES), snat_ip="198.18.0.1")
    rules = _uncomment(table.rules())
    svc = [r for r in rules if r.startswith("-A RAYPROOF-SERVICES")]
    assert len(svc) == 1 and svc[0].startswith("-A RAYPROOF-SERVICES -d 198.19.0.20/32 -p tcp -m tcp --dport 80 ")
    picks = [r for r in rules if r.startswith("-A RAYPROOF-SVC-")]
    assert "--probability 0.50000000000" in picks[0] and "statistic" not in picks[1] and len(picks) == 2
    dnat = sorted(r.split()[-1] for r in rules if "DNAT" in r)
    assert dnat == ["198.18.0.2:8080", "198.18.0.3:8080"], "the not-ready endpoint gets no traffic"
    assert any("-s 198.18.0.3/32 -j RAYPROOF-MARK-MASQ" in r for r in rules), "hairpin is marked for SNAT"


def test_dns_zone_for_cluster_ip_headless_and_pod_hostnames():
    eps = endpoints_from_slices(SLICES)
    zone = build_zone([Service("default", "web", "198.19.0.20", ()),
                       Service("default", "webhl", None, (), headless=True)],
                      {**eps, ("default", "webhl"): eps[("default", "web")]})
    assert zone["web.default.svc.cluster.local"] == ("198.19.0.20",)
    assert zone["webhl.default.svc.cluster.local"] == ("198.18.0.2", "198.18.0.3")
    assert zone["b.webhl.default.svc.cluster.local"] == ("198.18.0.3",)


def test_resolver_names_shorthands_nodata_and_nxdomain():
    r = dns.Resolver({"web.default.svc.cluster.local": ("198.19.0.20",)})
    for name in ("web.default.svc.cluster.local", "WEB.default.svc.cluster.local.", "web.default.svc", "web.default"):
        assert r.lookup(name) == (True, True, ("198.19.0.20",)), name
    assert r.lookup("nope.default.svc.cluster.local") == (True, False, ())
    assert r.lookup("default.svc.cluster.local") == (True, True, ()), "an empty non-terminal exists"
    assert r.lookup("10-1-2-3.default.pod.cluster.local") == (True, True, ("10.1.2.3",))
    assert r.lookup("example.com")[:2] == (False, False), "nothing outside the cluster domain is answered"


@pytest.fixture
def loopback_dns() -> Iterator[DnsServer]:
    """Function scope; a DNS server on 127.0.0.1 with an ephemeral port, stopped at teardown."""
    zone = {"web.default.svc.cluster.local": ("198.19.0.20",),
            "many.default.svc.cluster.local": tuple(f"198.18.1.{i}" for i in range(1, 61))}
    server = DnsServer("127.0.0.1", 0, zone).start()
    try:
        yield server
    finally:
        server.stop()


def test_dns_server_over_udp_and_tcp(loopback_dns):
    port = loopback_dns.port
    assert dns.query("127.0.0.1", "web.default.svc.cluster.local", port=port) == (0, ["198.19.0.20"], True)
    assert dns.query("127.0.0.1", "web.default", port=port, tcp=True) == (0, ["198.19.0.20"], True)
    assert dns.query("127.0.0.1", "web.default.svc.cluster.local", dns.TYPE_AAAA, port=port) == (0, [], True)
    assert dns.query("127.0.0.1", "nope.default.svc.cluster.local", port=port)[0] == dns.NXDOMAIN
    assert dns.query("127.0.0.1", "pypi.org", port=port)[0] == dns.NXDOMAIN
    # 60 answers do not fit 512 bytes: UDP is truncated, TCP carries all.
    assert len(dns.query("127.0.0.1", "many.default.svc.cluster.local", port=port)[1]) < 60
    assert len(dns.query("127.0.0.1", "many.default.svc.cluster.local", port=port, tcp=True)[1]) == 60


def test_an_ephemeral_port_another_process_holds_for_tcp_is_passed_over(monkeypatch):
    """Port 0: the kernel picks a free UDP port, whose TCP twin another process
    may hold (seen once in CI as EADDRINUSE); the server takes another. A
    given port is not changed."""
    import errno

    def taken_once(server):
        real, calls = server._bind_pair, []

        def bind():
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.EADDRINUSE, "Address already in use")
            return real()
        monkeypatch.setattr(server, "_bind_pair", bind)
        return calls

    server = DnsServer("127.0.0.1", 0, {"web.default.svc.cluster.local": ("198.19.0.20",)})
    calls = taken_once(server)
    server.start()
    try:
        assert len(calls) == 2
        assert dns.query("127.0.0.1", "web.default", port=server.port, tcp=True) == (0, ["198.19.0.20"], True)
    finally:
        server.stop()
    fixed = DnsServer("127.0.0.1", 5353, {})
    calls = taken_once(fixed)
    with pytest.raises(OSError):
        fixed.make_sockets()
    assert len(calls) == 1


def test_resolv_conf_is_what_the_kubelet_writes():
    assert dns.resolv_conf("ray") == ("search ray.svc.cluster.local svc.cluster.local cluster.local\n"
                                      "nameserver 198.19.0.10\noptions ndots:5\n")


def test_ipam_persists_across_instances_and_does_not_reuse_at_once(tmp_path):
    first = IPAM(tmp_path, "198.18.0.0/29", reserved=("198.18.0.1",))
    a, b = first.allocate("a"), first.allocate("b")
    assert (a, b) == ("198.18.0.2", "198.18.0.3")
    restarted = IPAM(tmp_path, "198.18.0.0/29", reserved=("198.18.0.1",))  # a new agent process
    assert restarted.allocate("a") == a and restarted.allocate("c") == "198.18.0.4"
    restarted.release("b")
    assert restarted.allocate("d") == "198.18.0.5", "a just-released address is not handed out next"


def test_cluster_state_counts_only_real_changes():
    state = ClusterState()
    obj = {"metadata": {"namespace": "default", "name": "x"}, "spec": {}}
    state.apply("services", "ADDED", obj)
    state.apply("services", "MODIFIED", dict(obj))
    state.replace("services", [obj])
    assert state.generation == 1
    state.apply("services", "DELETED", obj)
    state.apply("services", "DELETED", obj)
    assert state.generation == 2 and state.snapshot()[1]["services"] == []


# --- real namespaces ----------------------------------------------------------------------

def _require_root() -> None:
    try:
        check_available()
    except Exception as exc:  # noqa: BLE001 - the message says what to do
        pytest.fail(f"the pod network cannot run here: {exc}")


class Listener:
    """A TCP server on ``port`` inside a pod namespace that greets with the pod key
    (and, with ``with_peer``, the address the connection came from) and echoes lines."""

    def __init__(self, pod: PodAttachment, port: int, with_peer: bool = False):
        self.pod = pod
        self.with_peer = with_peer
        self.sock = _host.in_netns(pod.netns, lambda: socket.create_server(("0.0.0.0", port)))
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._echo, args=(conn, peer[0]), daemon=True).start()

    def _echo(self, conn: socket.socket, peer: str) -> None:
        greeting = f"{self.pod.pod_key} {peer}" if self.with_peer else self.pod.pod_key
        with contextlib.suppress(OSError):
            conn.sendall(greeting.encode() + b"\n")
            while data := conn.recv(4096):
                conn.sendall(data)

    def close(self) -> None:
        for s in [self.sock, *self.conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.thread.join()  # accept() returns at once after shutdown


def connect(src: PodAttachment, ip: str, port: int) -> str:
    """The greeting of ``ip:port`` as seen from pod ``src``, or ``error: …``."""
    def attempt() -> str:
        try:
            with socket.create_connection((ip, port), timeout=CONNECT_TIMEOUT_S) as s:
                return s.makefile().readline().strip()
        except OSError as exc:
            return f"error: {exc}"
    return _host.in_netns(src.netns, attempt)


@pytest.fixture
def podnet(tmp_path) -> Iterator[PodNetworkController]:
    """Function scope; a controller (no API server, fed by hand) with its own router namespace; closed at teardown."""
    _require_root()
    ctl = PodNetworkController(None, f"t{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "podnet")
    ctl.start()
    try:
        yield ctl
    finally:
        ctl.close()


@pytest.fixture
def two_pods(podnet) -> Iterator[tuple[PodAttachment, PodAttachment, list[Listener]]]:
    """Function scope; pods a (app=a) and b (app=b) in namespace default, b listening on 7000-7003 and 8000."""
    a, b = podnet.network.attach("default/a/uid-a"), podnet.network.attach("default/b/uid-b")
    for name, pod in (("a", a), ("b", b)):
        podnet.state.apply("pods", "ADDED", {"metadata": {"namespace": "default", "name": name,
                                                          "labels": {"app": name}},
                                             "status": {"podIP": pod.ip, "phase": "Running"}})
    podnet.state.apply("namespaces", "ADDED", {"metadata": {"name": "default"}})
    listeners = [Listener(b, port) for port in (7000, 7001, 7002, 7003, 8000)]
    podnet.wait_synced()
    try:
        yield a, b, listeners
    finally:
        for lst in listeners:
            lst.close()


def _set_policy(ctl: PodNetworkController, name: str, spec: dict | None) -> None:
    obj = _pol(name, spec or {})
    ctl.state.apply("networkpolicies", "DELETED" if spec is None else "ADDED", obj)
    ctl.wait_synced()


def test_two_pods_get_distinct_ips_and_reach_each_other_by_tcp(podnet):
    a, b = podnet.network.attach("default/a/1"), podnet.network.attach("default/b/2")
    assert a.ip != b.ip and a.netns != b.netns
    server = subprocess.Popen(b.exec_prefix() + [sys.executable, "-S", "-c",
                              "import socket; s = socket.create_server(('0.0.0.0', 7000)); c, peer = s.accept(); "
                              "c.sendall(peer[0].encode())"])
    try:
        client = "import socket, sys; print(socket.create_connection((sys.argv[1], 7000), timeout=1).recv(64).decode())"
        seen = wait_for(lambda: subprocess.run(a.exec_prefix() + [sys.executable, "-S", "-c", client, b.ip],
                                               capture_output=True, text=True, timeout=timeouts.PROCESS_EXIT.seconds),
                        lambda p: p.returncode == 0, timeout=timeouts.PROCESS_EXIT,
                        description=f"pod a to connect to pod b at {b.ip}:7000", interval=0.1)
        assert seen.stdout.strip() == a.ip, "b sees a's own pod address (no NAT between pods)"
    finally:
        server.kill()
        server.wait()
    assert podnet.network.attach("default/a/1") == a, "attach is idempotent"
    podnet.network.detach("default/a/1")
    podnet.network.detach("default/a/1")
    assert not _host.netns_exists(a.netns) and podnet.network.attachment("default/a/1") is None


def test_service_ip_dnats_to_backend_and_hairpins(podnet, two_pods):
    a, b, _ = two_pods
    hairpin = Listener(a, 8000)
    try:
        podnet.state.apply("services", "ADDED", {"metadata": {"namespace": "default", "name": "web"}, "spec": {
            "clusterIP": "198.19.0.20", "ports": [{"name": "http", "port": 80, "targetPort": 8000}]}})
        podnet.state.apply("endpointslices", "ADDED", {
            "metadata": {"namespace": "default", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": [b.ip], "conditions": {"ready": True}}]})
        podnet.wait_synced()
        assert connect(a, "198.19.0.20", 80) == b.pod_key
        # Endpoint moves to a itself: a reaches itself through its service (hairpin SNAT).
        podnet.state.apply("endpointslices", "MODIFIED", {
            "metadata": {"namespace": "default", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": [a.ip]}]})
        podnet.wait_synced()
        assert connect(a, "198.19.0.20", 80) == a.pod_key
        assert connect(a, "198.19.0.99", 80) == "error: [Errno 111] Connection refused", "no endpoints: REJECT"
    finally:
        hairpin.close()


def test_dns_answers_service_name_and_nxdomain_from_a_pod(podnet, two_pods, tmp_path):
    a, b, _ = two_pods
    podnet.state.apply("services", "ADDED", {"metadata": {"namespace": "ray", "name": "head-svc"}, "spec": {
        "clusterIP": "198.19.0.30", "ports": [{"port": 6379}]}})
    podnet.state.apply("services", "ADDED", {"metadata": {"namespace": "ray", "name": "headless"},
                                             "spec": {"clusterIP": "None"}})
    podnet.state.apply("endpointslices", "ADDED", {
        "metadata": {"namespace": "ray", "name": "headless-1", "labels": {"kubernetes.io/service-name": "headless"}},
        "endpoints": [{"addresses": [b.ip], "hostname": "worker-0"}]})
    podnet.wait_synced()
    ask = lambda name, **kw: _host.in_netns(a.netns, lambda: dns.query(DNS_IP, name, **kw))  # noqa: E731
    assert ask("head-svc.ray.svc.cluster.local") == (0, ["198.19.0.30"], True)
    assert ask("head-svc.ray.svc", tcp=True) == (0, ["198.19.0.30"], True)
    assert ask("headless.ray.svc.cluster.local") == (0, [b.ip], True)
    assert ask("worker-0.headless.ray.svc.cluster.local") == (0, [b.ip], True)
    assert ask("nope.ray.svc.cluster.local")[0] == dns.NXDOMAIN
    # The pod's own resolver (glibc) with the resolv.conf the node agent bind-mounts.
    conf = tmp_path / "resolv.conf"
    conf.write_text(podnet.network.resolv_conf("ray"))
    script = ("import socket, sys; print(socket.gethostbyname(sys.argv[1]))")
    resolved = subprocess.run(a.exec_prefix() + ["unshare", "-m", "--propagation", "private", "sh", "-c",
                                                 'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(conf),
                                                 sys.executable, "-S", "-c", script, "head-svc"],
                              capture_output=True, text=True, timeout=timeouts.PROCESS_EXIT.seconds)
    assert resolved.stdout.strip() == "198.19.0.30", resolved.stderr


def test_ingress_policy_denies_port_7000_keeps_7001_and_removal_restores(podnet, two_pods):
    a, b, _ = two_pods
    assert connect(a, b.ip, 7000) == b.pod_key
    _set_policy(podnet, "only-7001", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"],
                                      "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}],
                                                   "ports": [{"protocol": "TCP", "port": 7001}]}]})
    assert connect(a, b.ip, 7000) == "error: timed out", podnet.network.ruleset()["filter"]
    assert connect(a, b.ip, 7001) == b.pod_key
    _set_policy(podnet, "only-7001", None)
    assert connect(a, b.ip, 7000) == b.pod_key


def test_policy_port_range_with_end_port(podnet, two_pods):
    a, b, _ = two_pods
    _set_policy(podnet, "range", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"],
                                  "ingress": [{"ports": [{"port": 7001, "endPort": 7002}]}]})
    seen = {port: connect(a, b.ip, port) for port in (7000, 7001, 7002, 7003)}
    assert seen == {7000: "error: timed out", 7001: b.pod_key, 7002: b.pod_key, 7003: "error: timed out"}


def test_egress_policy_blocks(podnet, two_pods):
    a, b, _ = two_pods
    everything_but_b = {"ipBlock": {"cidr": "198.18.0.0/16", "except": [f"{b.ip}/32"]}}
    _set_policy(podnet, "egress", {"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
                                   "egress": [{"to": [everything_but_b]},
                                              {"to": [{"podSelector": {"matchLabels": {"app": "b"}}}],
                                               "ports": [{"port": 7001}]}]})
    assert connect(a, b.ip, 7000) == "error: timed out"
    assert connect(a, b.ip, 7001) == b.pod_key
    assert connect(b, a.ip, 9).startswith("error: [Errno 111]"), "a's ingress is not isolated: b reaches it (refused)"
    # DNS lives in the router ("the node"), so an egress policy never cuts it off.
    assert _host.in_netns(a.netns, lambda: dns.query(DNS_IP, "x.default"))[0] == dns.NXDOMAIN


def test_cluster_proxy_reaches_pods_from_the_root_namespace(podnet, two_pods):
    a, b, _ = two_pods
    podnet.state.apply("services", "ADDED", {"metadata": {"namespace": "default", "name": "web"}, "spec": {
        "clusterIP": "198.19.0.20", "ports": [{"port": 80, "targetPort": 7000}]}})
    podnet.state.apply("endpointslices", "ADDED", {
        "metadata": {"namespace": "default", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
        "ports": [{"port": 7000}], "endpoints": [{"addresses": [b.ip]}]})
    podnet.wait_synced()

    def via_proxy(request: bytes, lines: int) -> list[str]:
        """What the kube-apiserver egress dialer would see: the proxy's reply, then the upstream's bytes."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(CONNECT_TIMEOUT_S)
            s.connect(str(cluster_proxy_socket(podnet.network.state_dir)))
            s.sendall(request)
            f = s.makefile("rb")
            return [f.readline().decode().rstrip("\r\n") for _ in range(lines)]

    assert via_proxy(f"CONNECT {b.ip}:7000 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode(), 3) == [
        "HTTP/1.1 200 Connection established", "", b.pod_key]
    refused = via_proxy(b"CONNECT 192.0.2.1:80 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 1)
    assert refused == ["HTTP/1.1 403 Forbidden"], "nothing outside the pod and service ranges is dialled"
    # Absolute form by service name: resolved in the cluster zone, DNATed to b, which echoes the request.
    echoed = via_proxy(b"GET http://web.default.svc.cluster.local/x?y=1 HTTP/1.1\r\nHost: web\r\n"
                       b"Proxy-Connection: keep-alive\r\n\r\n", 5)
    assert echoed == [b.pod_key, "GET /x?y=1 HTTP/1.1", "Host: web", "Connection: close", ""]


def _open_conversation(src: PodAttachment, ip: str, port: int) -> socket.socket:
    sock = _host.in_netns(src.netns, lambda: socket.create_connection((ip, port), timeout=CONNECT_TIMEOUT_S))
    sock.makefile().readline()
    return sock


def _echo(sock: socket.socket) -> str:
    try:
        sock.sendall(b"ping\n")
        return sock.recv(64).decode().strip()
    except OSError as exc:
        return f"error: {exc}"


@pytest.mark.parametrize("recheck", [False, True], ids=["keep-established", "recheck-established"])
def test_policy_effect_on_an_already_open_connection(podnet, two_pods, recheck):
    a, b, _ = two_pods
    podnet.recheck_established = recheck
    podnet.wait_synced()
    sock = _open_conversation(a, b.ip, 7000)
    try:
        _set_policy(podnet, "deny-all", {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]})
        assert connect(a, b.ip, 7000) == "error: timed out"
        assert _echo(sock) == ("error: timed out" if recheck else "ping")
    finally:
        sock.close()


def test_close_leaves_no_namespace_chain_or_process(tmp_path):
    _require_root()
    ctl = PodNetworkController(None, f"t{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "podnet").start()
    net = ctl.network
    threads_before = set(threading.enumerate())
    pods = [net.attach(f"default/p{i}") for i in range(3)]
    inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in net.namespaces()}
    ctl.state.apply("networkpolicies", "ADDED", _pol("deny", {"podSelector": {}}))
    ctl.wait_synced()
    assert len(net.namespaces()) == 4 and "RAYPROOF-FORWARD" in net.ruleset()["filter"]
    assert ctl.threads, "the reconcile and DNS threads run while open"
    ctl.close()
    ctl.close()  # safe to repeat
    assert net.namespaces() == [] and not any(_host.netns_exists(p.netns) for p in pods)
    assert ctl.threads == [] and not (set(threading.enumerate()) - threads_before)
    # No process anywhere is inside a namespace of this network (the DNS server was a thread).
    inside = [pid for pid in os.listdir("/proc") if pid.isdigit() and _netns_inode(pid) in inodes]
    assert inside == [], f"processes {inside} are still inside the network's namespaces"
    assert net.attachments() == {}, "allocations are forgotten"


def _netns_inode(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


# --- the watch layer against a scripted API server ---------------------------------------

class ScriptedApi(http.server.ThreadingHTTPServer):
    """Loopback HTTP server answering LIST and WATCH of the five kinds the controller watches.

    ``lists[path]`` is a queue of list bodies (the last one repeats);
    ``watches[path]`` a queue of event lists, each served as one watch
    response that then stays open until the test ends (as a real watch does
    until its timeout).  ``calls`` records (path, watch?, resourceVersion).
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.lists: dict[str, list[dict]] = {}
        self.watches: dict[str, list[list[dict]]] = {}
        self.calls: list[tuple[str, bool, str | None]] = []
        self.closing = threading.Event()


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ScriptedApi

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        watch = query.get("watch", ["false"])[0] == "true"
        self.server.calls.append((url.path, watch, query.get("resourceVersion", [None])[0]))
        if not watch:
            bodies = self.server.lists.get(url.path) or [{"items": [], "metadata": {"resourceVersion": "1"}}]
            body = json.dumps(bodies.pop(0) if len(bodies) > 1 else bodies[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        queue = self.server.watches.get(url.path) or []
        events = queue.pop(0) if queue else []
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        if any(e["type"] == "ERROR" for e in events):
            self.wfile.write(b"0\r\n\r\n")  # the API server ends a watch after an ERROR event
            return
        self.server.closing.wait()  # an open watch with nothing to say, until the test ends


@pytest.fixture
def scripted_api(tmp_path) -> Iterator[tuple[ScriptedApi, Path]]:
    """Function scope; a scripted API server on loopback and a kubeconfig for it; shut down at teardown."""
    api = ScriptedApi()
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{api.server_address[1]}"}}],
        "users": [{"name": "t", "user": {}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    try:
        yield api, kubeconfig
    finally:
        api.closing.set()
        api.shutdown()
        api.server_close()


def _svc(name: str, ip: str, rv: str) -> dict:
    return {"metadata": {"namespace": "default", "name": name, "resourceVersion": rv},
            "spec": {"clusterIP": ip, "ports": [{"port": 80}]}}


def test_controller_lists_watches_and_relists_after_410(scripted_api):
    _require_root()
    api, kubeconfig = scripted_api
    api.lists["/api/v1/services"] = [{"items": [_svc("web", "198.19.0.20", "3")], "metadata": {"resourceVersion": "3"}}]
    api.watches["/api/v1/services"] = [[{"type": "ADDED", "object": _svc("api", "198.19.0.21", "4")},
                                        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "5"}}}]]
    api.lists["/api/v1/namespaces"] = [{"items": [], "metadata": {"resourceVersion": "5"}},
                                       {"items": [{"metadata": {"name": "default", "resourceVersion": "7"}}],
                                        "metadata": {"resourceVersion": "7"}}]
    api.watches["/api/v1/namespaces"] = [[{"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                                        "message": "too old resource version"}}]]
    ctl = PodNetworkController(kubeconfig, f"t{uuid.uuid4().hex[:8]}").start()
    try:
        assert ctl.network.state_dir == kubeconfig.parent / "podnet", "state beside the kubeconfig, in the run dir"
        zone = wait_for(lambda: ctl.network.dns.resolver.zone,
                        lambda z: "api.default.svc.cluster.local" in z, timeout=POD_NETWORK_SYNC,
                        description="the watched Service to reach the DNS zone", interval=0.05)
        assert zone["web.default.svc.cluster.local"] == ("198.19.0.20",), "from the LIST"
        assert zone["api.default.svc.cluster.local"] == ("198.19.0.21",), "from the WATCH"
        wait_for(lambda: [n["metadata"]["name"] for n in ctl.state.snapshot()[1]["namespaces"]],
                 lambda names: names == ["default"], timeout=POD_NETWORK_SYNC,
                 description="namespaces re-listed after 410 Gone", interval=0.05)
        ns_calls = [c for c in api.calls if c[0] == "/api/v1/namespaces"]
        assert ns_calls[:3] == [("/api/v1/namespaces", False, None), ("/api/v1/namespaces", True, "5"),
                                ("/api/v1/namespaces", False, None)]
        assert ("/api/v1/services", True, "3") in api.calls, "the watch starts at the list's resourceVersion"
    finally:
        ctl.close()  # watches are blocked reading open streams: stop() must cut them
    assert ctl.threads == []


def test_controller_process_serves_until_sigterm_and_teardown_removes_all(scripted_api):
    """How the platform runs it: a supervised process, then a registered cleanup."""
    _require_root()
    api, kubeconfig = scripted_api
    platform, state_dir = f"t{uuid.uuid4().hex[:8]}", kubeconfig.parent / "podnet"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "clusters.embedded.podnet", "run", "--kubeconfig", str(kubeconfig),
                             "--platform", platform], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ready = state_dir / "controller.ready"
        wait_for(lambda: ready.exists() or proc.poll() is not None, timeout=POD_NETWORK_SYNC, interval=0.05,
                 description="the controller process to list everything and write controller.ready")
        assert ready.read_text() == str(proc.pid)
        assert _host.list_netns(f"rayproof-{platform}-") == [f"rayproof-{platform}-net"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=timeouts.PROCESS_EXIT.seconds) == 0, proc.stdout.read().decode()[-2000:]
        assert not ready.exists()
        assert _host.list_netns(f"rayproof-{platform}-"), "stopping the controller keeps the network for a restart"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    down = subprocess.run([sys.executable, "-m", "clusters.embedded.podnet", "teardown", "--platform", platform,
                           "--state-dir", str(state_dir)], env=env, capture_output=True, text=True,
                          timeout=timeouts.PROCESS_EXIT.seconds)
    assert down.returncode == 0, down.stderr
    assert _host.list_netns(f"rayproof-{platform}-") == []
