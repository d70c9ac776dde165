"""NodePort on the embedded pod network: ``127.0.0.1:<nodePort>`` forwards to a service's ready endpoints.

First the compiler (pure), then a controller fed by hand with real router and
pod namespaces (as in test_podnet.py), then the session's embedded platform:
a NodePort Service made through the API is reachable from this process, and
no longer once it is switched back to ClusterIP.
"""
from __future__ import annotations

import contextlib
import secrets
import socket
import uuid
from typing import Iterator

import pytest
from kubernetes import client

from clusters.embedded.podnet import (
    NODE_IP,
    POD_NETWORK_SYNC,
    ROUTER_IP,
    Endpoint,
    NodePortForwarder,
    NodePortTarget,
    PodNetworkController,
    Service,
    ServicePort,
    check_available,
    compile_node_ports,
)
from core import timeouts
from core.waiting import wait_for
from fixtures.exposure import exposed_endpoints, probe_endpoints
from tests.embedded.test_podnet import Listener

CONNECT_TIMEOUT_S = 1.0  # socket timeout of one connection on loopback and veths


# --- compiler (pure) -------------------------------------------------------------------------

def _service(name: str, type_: str, node_port: int | None, protocol: str = "TCP") -> Service:
    return Service("ns", name, "198.19.0.40", (ServicePort("http", 80, protocol, 8080, node_port),), type_)


def test_compile_node_ports_needs_a_node_port_type_tcp_and_a_ready_endpoint():
    ready = [Endpoint("198.18.0.5", {("http", "TCP"): 8080}), Endpoint("198.18.0.6", {("http", "UDP"): 8080})]
    not_ready = [Endpoint("198.18.0.7", {("http", "TCP"): 8080}, ready=False)]
    services = [_service("np", "NodePort", 30001), _service("lb", "LoadBalancer", 30002),
                _service("cip", "ClusterIP", None), _service("udp", "NodePort", 30003, "UDP"),
                _service("idle", "NodePort", 30004), _service("unready", "NodePort", 30005)]
    eps = {("ns", "np"): ready, ("ns", "lb"): ready, ("ns", "cip"): ready, ("ns", "udp"): ready,
           ("ns", "unready"): not_ready}
    assert compile_node_ports(services, eps) == {
        30001: NodePortTarget("ns/np:http", "198.19.0.40", 80), 30002: NodePortTarget("ns/lb:http", "198.19.0.40", 80)}
    parsed = Service.from_api({"metadata": {"namespace": "ns", "name": "x"}, "spec": {
        "type": "NodePort", "clusterIP": "198.19.0.41", "ports": [{"port": 80, "nodePort": 30010}]}})
    assert parsed.ports[0].node_port == 30010


def test_forwarder_listens_only_on_loopback():
    with pytest.raises(ValueError, match="loopback"):
        NodePortForwarder("rayproof-x-net", node_ip="192.0.2.1")


# --- a controller fed by hand, real namespaces -------------------------------------------------

def _greeting(port: int) -> str:
    """The first line ``NODE_IP:port`` sends, or ``error: …``."""
    try:
        with socket.create_connection((NODE_IP, port), timeout=CONNECT_TIMEOUT_S) as s:
            return s.makefile().readline().strip() or "error: closed"
    except OSError as exc:
        return f"error: {exc}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((NODE_IP, 0))
        return s.getsockname()[1]


@pytest.fixture
def podnet(tmp_path) -> Iterator[PodNetworkController]:
    """Function scope; a controller (no API server, fed by hand) with its own router namespace; closed at teardown."""
    try:
        check_available()
    except Exception as exc:  # noqa: BLE001 - the message says what to do
        pytest.fail(f"the pod network cannot run here: {exc}")
    ctl = PodNetworkController(None, f"t{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "podnet").start()
    try:
        yield ctl
    finally:
        ctl.close()


def _feed(ctl: PodNetworkController, type_: str | None, node_port: int, ready: dict[str, bool]) -> None:
    """Service web (type ``type_``; None deletes it) with endpoints ``ip -> ready``, then wait until applied."""
    svc = {"metadata": {"namespace": "default", "name": "web"}, "spec": {
        "type": type_ or "NodePort", "clusterIP": "198.19.0.20",
        "ports": [{"name": "http", "port": 80, "targetPort": 8000,
                   **({"nodePort": node_port} if type_ in ("NodePort", "LoadBalancer") else {})}]}}
    ctl.state.apply("services", "DELETED" if type_ is None else "ADDED", svc)
    ctl.state.apply("endpointslices", "ADDED", {
        "metadata": {"namespace": "default", "name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": r}} for ip, r in ready.items()]})
    ctl.wait_synced()


def test_node_port_forwards_to_ready_endpoints_and_closes_when_gone(podnet):
    b, c = podnet.network.attach("default/b/uid-b"), podnet.network.attach("default/c/uid-c")
    servers = [Listener(b, 8000, with_peer=True), Listener(c, 8000, with_peer=True)]
    port = _free_port()
    try:
        _feed(podnet, "NodePort", port, {b.ip: True, c.ip: True})
        assert podnet.nodeports.ports == {port: "default/web:http"}
        greetings: set[str] = set()

        def greet() -> set[str]:
            greetings.add(_greeting(port))
            return set(greetings)

        seen = wait_for(greet, lambda g: len(g) >= 2, timeout=POD_NETWORK_SYNC, interval=0.05,
                        description="both endpoints answering behind the node port")
        # The pod sees the node (router) as the source, as after kube-proxy's masquerade.
        assert seen == {f"{b.pod_key} {ROUTER_IP}", f"{c.pod_key} {ROUTER_IP}"}, seen

        open_conn = socket.create_connection((NODE_IP, port), timeout=CONNECT_TIMEOUT_S)
        try:
            open_conn.makefile().readline()
            _feed(podnet, "NodePort", port, {b.ip: False, c.ip: False})
            assert _greeting(port) == "error: [Errno 111] Connection refused", "no ready endpoint: refused"
            _feed(podnet, "LoadBalancer", port, {b.ip: True, c.ip: False})
            assert _greeting(port) == f"{b.pod_key} {ROUTER_IP}", "a LoadBalancer's node port, to the ready one"
            _feed(podnet, "ClusterIP", port, {b.ip: True, c.ip: False})
            assert _greeting(port) == "error: [Errno 111] Connection refused", "back to ClusterIP: refused"
            assert podnet.nodeports.ports == {}
            _feed(podnet, "NodePort", port, {b.ip: True, c.ip: False})
            assert _greeting(port).startswith(b.pod_key)
            _feed(podnet, None, port, {b.ip: True, c.ip: False})
            assert _greeting(port) == "error: [Errno 111] Connection refused", "deleted: refused"
            open_conn.sendall(b"still here\n")
            assert open_conn.makefile().readline() == "still here\n", "a forwarded connection outlives its port"
        finally:
            open_conn.close()
    finally:
        for s in servers:
            s.close()
    podnet.close()
    assert podnet.threads == [], "stop() ends every listener and forwarding thread"


def test_on_real_nodes_the_router_holds_no_service_rule_and_no_node_port_listens_here(tmp_path):
    """``podnet run --no-services`` (the real nodes, where kube-proxy in each node does both): a NodePort
    Service with a ready endpoint gets no DNAT rule in the router and no listener on this machine."""
    try:
        check_available()
    except Exception as exc:  # noqa: BLE001 - the message says what to do
        pytest.fail(f"the pod network cannot run here: {exc}")
    ctl = PodNetworkController(None, f"t{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "podnet",
                               serve_services=False).start()
    try:
        b = ctl.network.attach("default/b/uid-b")
        server = Listener(b, 8000, with_peer=True)
        port = _free_port()
        try:
            _feed(ctl, "NodePort", port, {b.ip: True})
            nat = ctl.network.ruleset()["nat"]
            assert "198.19.0.20" not in nat and "DNAT" not in nat, nat
            assert ctl.nodeports.ports == {} and _greeting(port).startswith("error:"), _greeting(port)
        finally:
            server.close()
    finally:
        ctl.close()


def test_a_node_port_held_by_another_program_is_reported_then_served(podnet):
    b = podnet.network.attach("default/b/uid-b")
    server = Listener(b, 8000, with_peer=True)
    holder = socket.create_server((NODE_IP, 0))
    port = holder.getsockname()[1]
    try:
        _feed(podnet, "NodePort", port, {b.ip: True})
        assert list(podnet.nodeports.errors) == [port] and podnet.nodeports.ports == {}
        holder.close()
        wait_for(lambda: _greeting(port), lambda g: g.startswith(b.pod_key), timeout=POD_NETWORK_SYNC,
                 description=f"node port {port} to be bound once its holder let go", interval=0.2)
        assert podnet.nodeports.errors == {}
    finally:
        holder.close()
        server.close()


# --- the session's embedded platform -----------------------------------------------------------

RUN = secrets.token_hex(3)
LABELS = {"rayproof.io/run": RUN, "rayproof.io/test": "nodeport"}
HTTP_PORT = 8080
# A pod that answers every GET with its token.
HTTP_SERVER = ("import http.server, sys\n"
               "token = sys.argv[1].encode()\n"
               "class H(http.server.BaseHTTPRequestHandler):\n"
               "    def log_message(self, *a): pass\n"
               "    def do_GET(self):\n"
               "        self.send_response(200); self.send_header('Content-Length', str(len(token)))\n"
               "        self.end_headers(); self.wfile.write(token)\n"
               f"http.server.ThreadingHTTPServer(('0.0.0.0', {HTTP_PORT}), H).serve_forever()\n")


@pytest.fixture(scope="module")
def core(target) -> client.CoreV1Api:
    """Module scope; the session's embedded platform's core API (its teardown is the session's)."""
    if getattr(target, "kind", None) != "embedded":
        pytest.fail("this test exercises the embedded platform; run it without --kubeconfig")
    return client.CoreV1Api(target.platform.api_client())


@pytest.fixture
def namespace(core: client.CoreV1Api) -> Iterator[str]:
    """Function scope; a labelled namespace, deleted (and waited for) whatever happens."""
    name = f"rayproof-nodeport-{RUN}"
    core.create_namespace({"metadata": {"name": name, "labels": LABELS}})
    try:
        yield name
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(name)
        wait_for(lambda: [n.metadata.name for n in core.list_namespace().items if n.metadata.name == name],
                 lambda left: not left, timeout=timeouts.OBJECT_DELETE, description=f"namespace {name} to be deleted")


def _http_get(port: int) -> str:
    """Body of ``GET /`` at ``NODE_IP:port``, or ``error: …``."""
    try:
        with socket.create_connection((NODE_IP, port), timeout=CONNECT_TIMEOUT_S) as s:
            s.settimeout(timeouts.PROCESS_EXIT.seconds)  # socket timeout of the answer, not a wait
            s.sendall(f"GET / HTTP/1.1\r\nHost: {NODE_IP}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return body.decode() if head.startswith(b"HTTP/1.0 200") else f"error: {head[:80]!r}"
    except OSError as exc:
        return f"error: {exc}"


@pytest.mark.slow
def test_node_port_service_is_reachable_from_the_host_until_it_is_cluster_ip(core, namespace, evidence):
    token = f"rayproof-nodeport-{RUN}"
    core.create_namespaced_pod(namespace, {"metadata": {"name": "web", "labels": {**LABELS, "app": "web"}}, "spec": {
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "web", "image": "python:3.11", "command": ["python3", "-c", HTTP_SERVER, token],
                        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
                        "readinessProbe": {"tcpSocket": {"port": HTTP_PORT}, "periodSeconds": 1},
                        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                                      "limits": {"cpu": "200m", "memory": "128Mi"}}}]}})
    svc = core.create_namespaced_service(namespace, {"metadata": {"name": "web", "labels": LABELS}, "spec": {
        "type": "NodePort", "selector": {"app": "web"},
        "ports": [{"name": "http", "port": 80, "targetPort": HTTP_PORT}]}})
    node_port = svc.spec.ports[0].node_port
    assert node_port, f"the API server allocated no nodePort: {svc.spec}"
    evidence.record("node_port", node_port)
    wait_for(lambda: core.read_namespaced_pod("web", namespace).status.conditions or [],
             lambda conds: any(c.type == "Ready" and c.status == "True" for c in conds),
             timeout=timeouts.POD_START, description=f"pod {namespace}/web Ready", interval=0.5)
    body = wait_for(lambda: _http_get(node_port), lambda b: b == token, timeout=POD_NETWORK_SYNC, interval=0.5,
                    description=f"the pod's answer at {NODE_IP}:{node_port}")
    assert body == token

    # The same address is what exposed_endpoints lists, and what probe_endpoints reaches.
    net = client.NetworkingV1Api(core.api_client)
    mine = [e for e in exposed_endpoints(core, net, ports={HTTP_PORT: "test http"}) if e["namespace"] == namespace]
    assert {(e["via"], e["address"], e["port"]) for e in mine} == {("nodePort", NODE_IP, node_port)}, mine
    assert mine[0]["nodes"] == sorted(n.metadata.name for n in core.list_node().items), mine
    probed = probe_endpoints(mine[:1])
    evidence.record("probe_while_node_port", probed)
    assert probed[0]["reachable"], probed

    core.patch_namespaced_service("web", namespace, {"spec": {"type": "ClusterIP"}})
    gone = wait_for(lambda: _http_get(node_port), lambda b: "Connection refused" in b, timeout=POD_NETWORK_SYNC,
                    interval=0.5, description=f"{NODE_IP}:{node_port} to refuse once the Service is ClusterIP")
    evidence.record("after_cluster_ip", gone)
    assert not [e for e in exposed_endpoints(core, net, ports={HTTP_PORT: "test http"})
                if e["namespace"] == namespace]
    assert not probe_endpoints(mine[:1], timeout_s=5)[0]["reachable"]
