"""The embedded platform's pod network: the policy compiler from literals, then the real router in network namespaces.

The first half needs nothing (pure functions).  The second half builds a real
router and two nodes' namespaces linked to it as the platform does
(``nodes/fabric.py``; root, iproute2, iptables), gives each node's address to a
pod fed by hand to :class:`PodNetworkController` (the same path the API watch
feeds), and sends traffic between in-process sockets created inside the node
namespaces: every packet between them crosses the router, as every pod packet
does on the platform.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from clusters.embedded.nodes.fabric import NodeNet
from clusters.embedded.podnet import (
    POD_NETWORK_SYNC,
    ClusterState,
    Namespace,
    Pod,
    PodNetworkController,
    PolicyError,
    _host,
    check_available,
    cluster_proxy_socket,
    compile_policies,
)
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


def test_cluster_state_counts_only_real_changes():
    state = ClusterState()
    obj = {"metadata": {"namespace": "default", "name": "x"}, "spec": {}}
    state.apply("pods", "ADDED", obj)
    state.apply("pods", "MODIFIED", dict(obj))
    state.replace("pods", [obj])
    assert state.generation == 1
    state.apply("pods", "DELETED", obj)
    state.apply("pods", "DELETED", obj)
    assert state.generation == 2 and state.snapshot()[1]["pods"] == []
    assert sorted(state.snapshot()[1]) == ["namespaces", "networkpolicies", "pods"], "no Service kind is kept"


# --- real namespaces ----------------------------------------------------------------------

def _require_root() -> None:
    try:
        check_available()
    except Exception as exc:  # noqa: BLE001 - the message says what to do
        pytest.fail(f"the pod network cannot run here: {exc}")


@dataclass(frozen=True)
class NodePod:
    """A pod of the test: a node's namespace linked to the router (``NodeNet``), its address the pod's."""

    pod_key: str
    netns: str
    ip: str


def node_pod(ctl: PodNetworkController, index: int, pod_key: str) -> NodePod:
    node = NodeNet(ctl.network.platform, index)
    node.create()
    return NodePod(pod_key, node.netns, node.ip)


class Listener:
    """A TCP server on ``port`` inside a pod's namespace that greets with the pod key
    (and, with ``with_peer``, the address the connection came from) and echoes lines."""

    def __init__(self, pod: NodePod, port: int, with_peer: bool = False):
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


def connect(src: NodePod, ip: str, port: int) -> str:
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
def two_pods(podnet) -> Iterator[tuple[NodePod, NodePod, list[Listener]]]:
    """Function scope; pods a (app=a) and b (app=b) in namespace default, on nodes 1 and 2, b listening on
    7000-7003 and 8000 (the nodes' namespaces go with the controller's close)."""
    a, b = node_pod(podnet, 1, "default/a/uid-a"), node_pod(podnet, 2, "default/b/uid-b")
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


def test_cluster_proxy_reaches_pods_from_the_root_namespace(podnet, two_pods):
    a, b, _ = two_pods

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
    for outside in ("192.0.2.1:80", "127.0.0.1:10250", "web.default.svc.cluster.local:80"):
        refused = via_proxy(f"CONNECT {outside} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode(), 1)
        assert refused == ["HTTP/1.1 403 Forbidden"], f"{outside}: only pod and service addresses are dialled"
    # Absolute form by address: b echoes the request the proxy rewrote.
    echoed = via_proxy(f"GET http://{b.ip}:7000/x?y=1 HTTP/1.1\r\nHost: web\r\n"
                       "Proxy-Connection: keep-alive\r\n\r\n".encode(), 5)
    assert echoed == [b.pod_key, "GET /x?y=1 HTTP/1.1", "Host: web", "Connection: close", ""]


def _open_conversation(src: NodePod, ip: str, port: int) -> socket.socket:
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
    pods = [node_pod(ctl, i, f"default/p{i}") for i in range(1, 4)]
    inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in net.namespaces()}
    ctl.state.apply("networkpolicies", "ADDED", _pol("deny", {"podSelector": {}}))
    ctl.wait_synced()
    assert len(net.namespaces()) == 4 and "RAYPROOF-FORWARD" in net.ruleset()["filter"]
    assert "RAYPROOF" not in net.ruleset()["nat"], "the router holds no nat rule: kube-proxy translates Services"
    assert ctl.threads, "the reconcile and proxy threads run while open"
    ctl.close()
    ctl.close()  # safe to repeat
    assert net.namespaces() == [] and not any(_host.netns_exists(p.netns) for p in pods)
    assert ctl.threads == [] and not (set(threading.enumerate()) - threads_before)
    # No process anywhere is inside a namespace of this network (the controller's are threads).
    inside = [pid for pid in os.listdir("/proc") if pid.isdigit() and _netns_inode(pid) in inodes]
    assert inside == [], f"processes {inside} are still inside the network's namespaces"


def _netns_inode(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


# --- the watch layer against a scripted API server ---------------------------------------

class ScriptedApi(http.server.ThreadingHTTPServer):
    """Loopback HTTP server answering LIST and WATCH of the three kinds the controller watches.

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


def _pod(name: str, ip: str, rv: str) -> dict:
    return {"metadata": {"namespace": "default", "name": name, "resourceVersion": rv, "labels": {"app": name}},
            "spec": {"nodeName": "rayproof-node-1"}, "status": {"podIP": ip, "phase": "Running"}}


def test_controller_lists_watches_and_relists_after_410(scripted_api):
    _require_root()
    api, kubeconfig = scripted_api
    api.lists["/api/v1/pods"] = [{"items": [_pod("web", "198.18.201.2", "3")], "metadata": {"resourceVersion": "3"}}]
    api.watches["/api/v1/pods"] = [[{"type": "ADDED", "object": _pod("api", "198.18.201.3", "4")},
                                    {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "5"}}}]]
    api.lists["/apis/networking.k8s.io/v1/networkpolicies"] = [{"items": [
        {**_pol("deny-web", {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}),
         "metadata": {"namespace": "default", "name": "deny-web", "resourceVersion": "2"}}],
        "metadata": {"resourceVersion": "3"}}]
    api.lists["/api/v1/namespaces"] = [{"items": [], "metadata": {"resourceVersion": "5"}},
                                       {"items": [{"metadata": {"name": "default", "resourceVersion": "7"}}],
                                        "metadata": {"resourceVersion": "7"}}]
    api.watches["/api/v1/namespaces"] = [[{"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                                        "message": "too old resource version"}}]]
    ctl = PodNetworkController(kubeconfig, f"t{uuid.uuid4().hex[:8]}").start()
    try:
        assert ctl.network.state_dir == kubeconfig.parent / "podnet", "state beside the kubeconfig, in the run dir"
        pods = wait_for(lambda: sorted(p["metadata"]["name"] for p in ctl.state.snapshot()[1]["pods"]),
                        lambda names: names == ["api", "web"], timeout=POD_NETWORK_SYNC,
                        description="the listed and the watched pod in the controller's state", interval=0.05)
        assert pods == ["api", "web"], "web from the LIST, api from the WATCH"
        wait_for(lambda: ctl.network.ruleset()["filter"], lambda rules: "-d 198.18.201.2/32" in rules,
                 timeout=POD_NETWORK_SYNC, description="the listed policy to isolate the listed pod in the router",
                 interval=0.05)
        wait_for(lambda: [n["metadata"]["name"] for n in ctl.state.snapshot()[1]["namespaces"]],
                 lambda names: names == ["default"], timeout=POD_NETWORK_SYNC,
                 description="namespaces re-listed after 410 Gone", interval=0.05)
        ns_calls = [c for c in api.calls if c[0] == "/api/v1/namespaces"]
        assert ns_calls[:3] == [("/api/v1/namespaces", False, None), ("/api/v1/namespaces", True, "5"),
                                ("/api/v1/namespaces", False, None)]
        assert ("/api/v1/pods", True, "3") in api.calls, "the watch starts at the list's resourceVersion"
        assert not [c for c in api.calls if "services" in c[0] or "endpointslices" in c[0]], "no Service is watched"
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
        nat = _host.iptables_save(f"rayproof-{platform}-net", "nat")
        assert "RAYPROOF" not in nat, f"the router holds no Service rule (kube-proxy in each node does): {nat}"
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
