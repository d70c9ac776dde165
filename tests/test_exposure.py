"""fixtures/exposure.py: which addresses the cluster reports for Ray's control ports, and the probe of them.

The API objects are the Kubernetes client's own models (so attribute names are
the real ones) behind a fake API; the probe runs against sockets on loopback.
"""
from __future__ import annotations

import http.server
import json
import socket
from types import SimpleNamespace
from typing import Iterator

import pytest
from kubernetes import client as k

from fixtures import exposure
from fixtures.exposure import EXPOSURE_PROBE, exposed_endpoints, probe_endpoints
from tests.loopback_http import serving


class FakeApi:
    """CoreV1Api and NetworkingV1Api list calls, answered from lists of models."""

    def __init__(self, nodes=(), services=(), ingresses=(), pods=()):
        self.nodes, self.services, self.ingresses, self.pods = list(nodes), list(services), list(ingresses), list(pods)

    def list_pod_for_all_namespaces(self):
        return SimpleNamespace(items=self.pods)

    def list_node(self):
        return SimpleNamespace(items=self.nodes)

    def list_service_for_all_namespaces(self):
        return SimpleNamespace(items=self.services)

    def list_ingress_for_all_namespaces(self):
        return SimpleNamespace(items=self.ingresses)


def node(name: str, *addresses: tuple[str, str]) -> k.V1Node:
    return k.V1Node(metadata=k.V1ObjectMeta(name=name),
                    status=k.V1NodeStatus(addresses=[k.V1NodeAddress(type=t, address=a) for t, a in addresses]))


def service(ns: str, name: str, type_: str, ports: list[k.V1ServicePort], *, external_ips=None,
            lb: list[dict] | None = None) -> k.V1Service:
    status = k.V1ServiceStatus(load_balancer=k.V1LoadBalancerStatus(
        ingress=[k.V1LoadBalancerIngress(**i) for i in lb])) if lb else None
    return k.V1Service(metadata=k.V1ObjectMeta(namespace=ns, name=name),
                       spec=k.V1ServiceSpec(type=type_, ports=ports, external_ips=external_ips), status=status)


def ingress(ns: str, name: str, backend_svc: str, port: int | str, *, host: str | None = None,
            lb: list[dict] | None = None, annotations: dict | None = None) -> k.V1Ingress:
    backend_port = k.V1ServiceBackendPort(number=port) if isinstance(port, int) else k.V1ServiceBackendPort(name=port)
    backend = k.V1IngressBackend(service=k.V1IngressServiceBackend(name=backend_svc, port=backend_port))
    rule = k.V1IngressRule(host=host, http=k.V1HTTPIngressRuleValue(
        paths=[k.V1HTTPIngressPath(path="/", path_type="Prefix", backend=backend)]))
    status = k.V1IngressStatus(load_balancer=k.V1IngressLoadBalancerStatus(
        ingress=[k.V1IngressLoadBalancerIngress(**i) for i in lb])) if lb else None
    return k.V1Ingress(metadata=k.V1ObjectMeta(namespace=ns, name=name, annotations=annotations),
                       spec=k.V1IngressSpec(rules=[rule]), status=status)


NODES = [node("n1", ("InternalIP", "10.0.0.1"), ("Hostname", "n1")),
         node("n2", ("InternalIP", "10.0.0.2"), ("ExternalIP", "203.0.113.2"))]


def _where(eps: list[dict]) -> set[tuple]:
    return {(e["kind"], e["namespace"], e["name"], e["via"], e["address"], e["port"], e["surface"]) for e in eps}


def test_cluster_ip_services_and_unrelated_ports_expose_nothing():
    api = FakeApi(NODES, [
        service("a", "head", "ClusterIP", [k.V1ServicePort(port=8265), k.V1ServicePort(port=10001)]),
        service("a", "web", "NodePort", [k.V1ServicePort(port=80, target_port=8080, node_port=30080)])])
    assert exposed_endpoints(api, api) == []


def test_node_port_gives_every_node_address_at_its_node_port():
    api = FakeApi(NODES, [service("t1", "head", "NodePort", [
        k.V1ServicePort(name="dashboard", port=8265, node_port=30001),
        k.V1ServicePort(name="gcs", port=6379, node_port=30002),
        k.V1ServicePort(name="metrics", port=8080, node_port=30003)])])
    eps = exposed_endpoints(api, api)
    assert _where(eps) == {("Service", "t1", "head", "nodePort", ip, port, surface)
                           for ip in ("10.0.0.1", "10.0.0.2", "203.0.113.2")
                           for port, surface in ((30001, "dashboard/Jobs API"), (30002, "GCS"))}
    dash = [e for e in eps if e["port"] == 30001 and e["address"] == "10.0.0.1"][0]
    assert dash["nodes"] == ["n1"] and dash["ray_port"] == 8265 and dash["scheme"] == "http"
    assert {e["scheme"] for e in eps if e["ray_port"] == 6379} == {"tcp"}


def test_load_balancer_external_ips_and_a_target_port_of_another_number():
    api = FakeApi(NODES, [
        service("t2", "lb", "LoadBalancer", [k.V1ServicePort(port=443, target_port=8265, node_port=31000)],
                lb=[{"ip": "198.51.100.7"}, {"hostname": "lb.example.test"}]),
        service("t3", "ext", "ClusterIP", [k.V1ServicePort(port=10001, target_port="10001")],
                external_ips=["192.0.2.9"])])
    got = _where(exposed_endpoints(api, api))
    assert ("Service", "t2", "lb", "loadBalancer", "198.51.100.7", 443, "dashboard/Jobs API") in got
    assert ("Service", "t2", "lb", "loadBalancer", "lb.example.test", 443, "dashboard/Jobs API") in got
    assert ("Service", "t2", "lb", "nodePort", "203.0.113.2", 31000, "dashboard/Jobs API") in got
    assert ("Service", "t3", "ext", "externalIP", "192.0.2.9", 10001, "Ray client") in got
    assert len(got) == 6, got


def test_ingress_to_a_ray_service_on_80_and_443_with_its_auth_annotations_recorded():
    head = service("t4", "head", "ClusterIP", [k.V1ServicePort(name="dashboard", port=8265)])
    api = FakeApi(NODES, [head], [
        ingress("t4", "by-host", "head", 8265, host="ray.example.test"),
        ingress("t4", "by-lb", "head", "dashboard", host="ray.example.test", lb=[{"ip": "198.51.100.8"}],
                annotations={"nginx.ingress.kubernetes.io/auth-url": "https://auth"}),
        ingress("t4", "other-port", "head", 9999, host="x.example.test"),
        ingress("t5", "other-namespace", "head", 8265, host="y.example.test")])
    eps = exposed_endpoints(api, api)
    assert _where(eps) == {("Ingress", "t4", "by-host", "ingress", "ray.example.test", p, "dashboard/Jobs API")
                           for p in (80, 443)} | {
        ("Ingress", "t4", "by-lb", "ingress", "198.51.100.8", p, "dashboard/Jobs API") for p in (80, 443)}
    by_lb = [e for e in eps if e["name"] == "by-lb" and e["port"] == 443][0]
    assert by_lb["host"] == "ray.example.test" and by_lb["scheme"] == "https"
    assert by_lb["auth_annotations"] == ["nginx.ingress.kubernetes.io/auth-url"]


def test_nodes_sharing_an_address_give_one_endpoint():
    api = FakeApi([node("a", ("InternalIP", "127.0.0.1")), node("b", ("InternalIP", "127.0.0.1"))],
                  [service("t", "s", "NodePort", [k.V1ServicePort(port=10001, node_port=30020)])])
    (ep,) = exposed_endpoints(api, api)
    assert (ep["address"], ep["port"], ep["nodes"], ep["surface"]) == ("127.0.0.1", 30020, ["a", "b"], "Ray client")


def test_ports_argument_narrows_the_surfaces():
    api = FakeApi(NODES[:1], [service("t", "s", "NodePort", [k.V1ServicePort(port=6379, node_port=30010),
                                                             k.V1ServicePort(port=8265, node_port=30011)])])
    assert [e["port"] for e in exposed_endpoints(api, api, ports={6379: "GCS"})] == [30010]


# --- the probe ------------------------------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    status = 200

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = json.dumps({"ray_version": "2.60.0", "version": "4"} if self.path == "/api/version" else {}).encode()
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def http_server() -> Iterator[http.server.ThreadingHTTPServer]:
    """Function scope; a loopback HTTP server answering /api/version like Ray's Jobs API; shut down after."""
    with serving(_Handler) as server:
        server.status = 200  # type: ignore[attr-defined]
        yield server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed: connects are refused


def _ep(port: int, scheme: str = "http", surface: str = "dashboard/Jobs API") -> dict:
    return {"kind": "Service", "namespace": "t", "name": "s", "via": "nodePort", "address": "127.0.0.1",
            "port": port, "scheme": scheme, "surface": surface}


def test_probe_reachable_dashboard_answers_and_closed_port_is_refused(http_server):
    open_port = http_server.server_address[1]
    closed = _closed_port()
    dash, tcp_only, refused = probe_endpoints([_ep(open_port), _ep(open_port, "tcp", "GCS"), _ep(closed)])
    assert dash["reachable"] and dash["answered_http"] and dash["http_status"] == 200 and dash["ray_answered"]
    assert dash["first_bytes"].startswith("HTTP/1.0 200") and dash["attempts"] == 1 and dash["error"] is None
    assert dash["name"] == "s", "the endpoint's own keys are kept"
    assert tcp_only["reachable"] and not tcp_only["answered_http"] and tcp_only["first_bytes"] is None
    assert not refused["reachable"] and "ConnectionRefused" in refused["error"]
    assert refused["attempts"] == exposure.ATTEMPTS, "a refused endpoint is tried a few times, no more"
    assert refused["seconds"] < EXPOSURE_PROBE.seconds


def test_probe_records_an_authenticating_answer_and_a_silent_listener(http_server):
    http_server.status = 401  # type: ignore[attr-defined]
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        auth, mute = probe_endpoints([_ep(http_server.server_address[1]), _ep(silent.getsockname()[1])],
                                     timeout_s=2)
    finally:
        silent.close()
    assert auth["reachable"] and auth["answered_http"] and auth["http_status"] == 401 and not auth["ray_answered"]
    # Connects (the backlog accepts), never answers: reachable, no HTTP, bounded by the timeout.
    assert mute["reachable"] and not mute["answered_http"] and "HTTP failed" in mute["error"]
    assert mute["seconds"] < 2 + exposure.CONNECT_TIMEOUT_S


def test_probe_refuses_what_is_not_an_endpoint():
    with pytest.raises(ValueError):
        probe_endpoints([{"address": "127.0.0.1"}])
    assert probe_endpoints([]) == []


def test_other_tenants_names_and_hosts_are_hashed_the_suites_own_kept():
    own = service("rp-sec-1-ab12-a", "suite-head", "NodePort",
                  [k.V1ServicePort(name="gcs", port=6379, node_port=30379)])
    theirs = service("payroll", "payroll-ray-head", "NodePort",
                     [k.V1ServicePort(name="gcs", port=6379, node_port=30380)])
    head = service("payroll", "head", "ClusterIP", [k.V1ServicePort(name="dashboard", port=8265)])
    api = FakeApi(NODES, [own, theirs, head], [ingress("payroll", "ray-ui", "head", 8265, host="ray.payroll.example")])
    shown = exposure.tenant_names_hashed(exposed_endpoints(api, api), ["rp-sec-1-ab12-a"])
    text = json.dumps(shown)
    assert "payroll" not in text, text
    assert {e["name"] for e in shown if e["namespace"] == "rp-sec-1-ab12-a"} == {"suite-head"}
    hashed = {e["name"] for e in shown if e["namespace"] != "rp-sec-1-ab12-a"}
    assert hashed == {exposure.tenant_names_hashed([{"namespace": "payroll", "name": n}], [])[0]["name"]
                      for n in ("payroll-ray-head", "ray-ui")}, "one object, one hash"
    assert all(e["address"].startswith("tenant-") for e in shown if e["via"] == "ingress")


def pod(ns: str, name: str, *, host_network: bool = False, ports=(), ray: bool = True) -> k.V1Pod:
    labels = {"ray.io/node-type": "head"} if ray else {}
    return k.V1Pod(metadata=k.V1ObjectMeta(namespace=ns, name=name, labels=labels),
                   spec=k.V1PodSpec(host_network=host_network, node_name="n1", containers=[k.V1Container(
                       name="ray-head", ports=[k.V1ContainerPort(container_port=c, host_port=h) for c, h in ports])]),
                   status=k.V1PodStatus(phase="Running", host_ip="127.0.0.1"))


def test_heads_on_the_nodes_own_network_are_exposed_endpoints():
    """A head with hostNetwork serves every Ray port on its node's address; a
    hostPort maps one there; a plain pod or a non-Ray pod on the host network
    exposes nothing of Ray's."""
    api = FakeApi(pods=[pod("a", "net-head", host_network=True),
                        pod("a", "port-head", ports=[(8265, 30265), (8080, None)]),
                        pod("a", "plain-head", ports=[(8265, None)]),
                        pod("kube-system", "agent", host_network=True, ray=False)])
    found = {(e["name"], e["via"], e["address"], e["port"], e["ray_port"]) for e in exposed_endpoints(api, api)}
    assert found == {("net-head", "hostNetwork", "127.0.0.1", 8265, 8265),
                     ("net-head", "hostNetwork", "127.0.0.1", 10001, 10001),
                     ("net-head", "hostNetwork", "127.0.0.1", 6379, 6379),
                     ("port-head", "hostPort", "127.0.0.1", 30265, 8265)}, found
