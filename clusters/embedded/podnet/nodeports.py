"""NodePort: a Service reachable at ``<node address>:<nodePort>`` from the machine, as kube-proxy makes it.

For a Service of type NodePort (or LoadBalancer, whose ports get node ports
too) the API server allocates ``spec.ports[].nodePort``; kube-proxy then
DNATs ``<node IP>:<nodePort>`` to the service's endpoints in the node's own
namespace.  Every node of this platform reports ``InternalIP`` 127.0.0.1
(``nodeagent/registration.py``), and the safety rule forbids iptables rules in
the machine's root namespace, so the same effect is a userspace forwarder, run
by the pod network controller (threads of its process, like DNS and the
cluster proxy)::

    client (root namespace) -> 127.0.0.1:<nodePort>      listener made here, in the root namespace
    forwarder -> <cluster IP>:<port>                   socket made in the router namespace (``_host.in_netns``),
                                                       bound to the router's address 198.18.0.1
    router nat OUTPUT -> RAYPROOF-SERVICES             the service's DNAT picks a ready endpoint, as for pods

So a node port spreads connections over the ready endpoints exactly as the
cluster IP does, the pod sees the node's (router's) address as the source,
like kube-proxy's masquerade of NodePort traffic, and, like all traffic of
"the node", it crosses no NetworkPolicy.  A port is listened on only while
its service port has at least one ready endpoint (kube-proxy REJECTs a
node port without endpoints: the client's connect is refused); a service
deleted, changed back to ClusterIP or left without ready endpoints closes its
listener at the next apply.  Connections already forwarded stay open until
either side closes them, as conntrack keeps an established flow.

Safety: the listener address must be a loopback address (the only node
address this platform reports), and the forwarder dials only cluster IPs of
the service range from inside the router namespace, which has no way off the
machine.  Not done: UDP/SCTP node ports, ``externalTrafficPolicy: Local``,
node ports from inside a pod (127.0.0.1 there is the pod's own loopback).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

from clusters.embedded.podnet import _host
from clusters.embedded.podnet.model import Endpoint, Pod, Service
from clusters.embedded.podnet.proxy import DIAL_TIMEOUT_S, splice
from clusters.embedded.podnet.services import ready_endpoints

log = logging.getLogger(__name__)

# What every node of the embedded platform reports as its InternalIP.
NODE_IP = "127.0.0.1"
NODE_PORT_TYPES = ("NodePort", "LoadBalancer")


@dataclass(frozen=True)
class NodePortTarget:
    """Where one node port forwards: a service port's cluster IP (or, for a
    pod's hostPort, the pod's address and container port)."""

    label: str  # "<namespace>/<name>:<port name or number>", for logs and evidence
    cluster_ip: str
    port: int


def compile_node_ports(services: Iterable[Service],
                       endpoints: Mapping[tuple[str, str], list[Endpoint]]) -> dict[int, NodePortTarget]:
    """nodePort -> target, for TCP ports of NodePort/LoadBalancer services that have a ready endpoint."""
    out: dict[int, NodePortTarget] = {}
    for svc in sorted(services, key=lambda s: (s.namespace, s.name)):
        if svc.type not in NODE_PORT_TYPES or svc.headless or not svc.cluster_ip:
            continue
        eps = endpoints.get((svc.namespace, svc.name), [])
        for port in svc.ports:
            if port.protocol != "TCP" or not port.node_port or not ready_endpoints(port, eps):
                continue
            # The API server never gives one node port to two services; first wins if fed otherwise.
            out.setdefault(port.node_port, NodePortTarget(f"{svc.namespace}/{svc.name}:{port.name or port.port}",
                                                          svc.cluster_ip, port.port))
    return out


def compile_host_ports(pods: Iterable[Pod]) -> dict[int, NodePortTarget]:
    """hostPort -> the pod's address and container port, for running pods'
    TCP hostPorts: what the CNI portmap plugin maps on a real node. Every
    node of the node agent has the address :data:`NODE_IP`, so two pods
    asking for one hostPort are one port here: the first (by namespace and
    name) wins, as the scheduler would have kept them on different nodes."""
    out: dict[int, NodePortTarget] = {}
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        for host_port, container_port in sorted(pod.host_ports.items()):
            if pod.ip:
                out.setdefault(host_port, NodePortTarget(f"{pod.namespace}/{pod.name}:{container_port} (hostPort)",
                                                         pod.ip, container_port))
    return out


class NodePortForwarder:
    """Listens on ``node_ip``:<nodePort> in this namespace; dials the target from inside ``router_netns``.

    ``update(ports)`` makes the set of listeners equal ``ports``; ports that
    cannot be bound (another program of the machine holds them) are left out
    and named in :attr:`errors`, and tried again at the next ``update``.
    """

    def __init__(self, router_netns: str, *, node_ip: str = NODE_IP, source_ip: str | None = None,
                 allowed: tuple[str, ...] = ()):
        if not ipaddress.ip_address(node_ip).is_loopback:
            raise ValueError(f"node ports listen only on a loopback address of this machine, not {node_ip}")
        self.router = router_netns
        self.node_ip = node_ip
        self.source_ip = source_ip
        self.allowed = tuple(ipaddress.ip_network(n) for n in allowed)
        self.errors: dict[int, str] = {}
        self._targets: dict[int, NodePortTarget] = {}
        self._listeners: dict[int, socket.socket] = {}
        self._open: set[socket.socket] = set()
        self._threads = _host.Threads("podnet-nodeport")
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def ports(self) -> dict[int, str]:
        """nodePort -> service port label, for every port listened on now (evidence)."""
        with self._lock:
            return {p: self._targets[p].label for p in sorted(self._listeners)}

    @property
    def threads(self) -> list[threading.Thread]:
        return self._threads.alive()

    def start(self) -> "NodePortForwarder":
        self._stopping.clear()
        return self

    def update(self, ports: Mapping[int, NodePortTarget]) -> None:
        """Listen on exactly ``ports`` (those that can be bound), forwarding each to its target."""
        wanted = {p: t for p, t in ports.items() if self._dialable(t)}
        with self._lock:
            if self._stopping.is_set():
                return
            self._targets = dict(wanted)  # each accept reads its port's target now
            for port in sorted(set(self._listeners) - set(wanted)):
                _close(self._listeners.pop(port))
            errors = {}
            for port in sorted(set(wanted) - set(self._listeners)):
                try:
                    listener = socket.create_server((self.node_ip, port), backlog=128)
                except OSError as exc:
                    errors[port] = f"{self.node_ip}:{port} ({wanted[port].label}): {exc}"
                    continue
                self._listeners[port] = listener
                self._threads.spawn(self._accept_loop, port, listener)
        if errors and errors != self.errors:
            log.warning("node ports not served: %s", "; ".join(errors.values()))
        self.errors = errors

    def _dialable(self, target: NodePortTarget) -> bool:
        ip = ipaddress.ip_address(target.cluster_ip)
        if any(ip in net for net in self.allowed):
            return True
        log.warning("node port of %s not served: cluster IP %s is outside %s", target.label, ip,
                    ", ".join(map(str, self.allowed)))
        return False

    def _accept_loop(self, port: int, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed by update() or stop()
            with self._lock:
                target = self._targets.get(port) if self._listeners.get(port) is listener else None
                if target is None or self._stopping.is_set():
                    _reset(conn)
                    continue
                self._open.add(conn)
                self._threads.spawn(self._forward, conn, target)

    def _forward(self, client: socket.socket, target: NodePortTarget) -> None:
        upstream = None

        def dial() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.settimeout(DIAL_TIMEOUT_S)
                if self.source_ip:
                    s.bind((self.source_ip, 0))
                s.connect((target.cluster_ip, target.port))
            except OSError:
                s.close()
                raise
            return s

        try:
            try:
                upstream = _host.in_netns(self.router, dial)
            except OSError as exc:
                log.info("node port %s: dialing %s:%s failed: %s", target.label, target.cluster_ip, target.port, exc)
                return _reset(client)
            upstream.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    return
                self._open.add(upstream)
            splice(client, upstream, "podnet-nodeport-copy")
        finally:
            for s in (upstream, client):
                if s is not None:
                    with self._lock:
                        self._open.discard(s)
                    s.close()

    def stop(self) -> None:
        """Close every listener and forwarded connection; safe to repeat.  Callers wait on :attr:`threads`."""
        self._stopping.set()
        with self._lock:
            listeners, conns = list(self._listeners.values()), list(self._open)
            self._listeners.clear()
            self._targets.clear()
        for s in listeners:
            _close(s)
        for s in conns:  # the forwarding threads close these once they have let go
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.errors = {}


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)  # wakes accept() and recv() in the worker threads
    except OSError:
        pass
    s.close()


def _reset(conn: socket.socket) -> None:
    """Close with a RST, so the client sees the connection refused rather than an orderly end."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()
