"""A way into the pod network for processes in the machine's own namespace, without a route.

The API server's service and pod proxy (which KubeRay's
``--use-kubernetes-proxy`` uses to reach Ray dashboards) dials pod addresses
from wherever the API server runs.  Pods live behind the router namespace and
the safety rule forbids routes or NAT in the machine's root namespace, so
nothing there can reach 198.18.0.0/16 directly.  Instead the API server's
*egress selector* sends its "cluster" traffic through an HTTP CONNECT proxy
on a Unix socket, and this proxy opens the outgoing TCP connection from a
socket created inside the router namespace (setns'd helper thread; see
``_host.in_netns``), then copies bytes both ways::

    # kube-apiserver --egress-selector-config-file=<file>
    apiVersion: apiserver.k8s.io/v1beta1
    kind: EgressSelectorConfiguration
    egressSelections:
    - name: cluster
      connection:
        proxyProtocol: HTTPConnect
        transport:
          uds:
            udsName: <state_dir>/cluster-proxy.sock

(The TCP transport of the egress selector always speaks TLS to the proxy, so
the Unix socket is the simple one.)  An optional loopback TCP port also takes
absolute-form requests (``GET http://198.18.201.5:8265/…``), so a process
given ``HTTP_PROXY=http://127.0.0.1:<port>`` (Go's net/http honours it)
reaches pods by address.  Only addresses of the pod range (pods, and the
nodes' kubelets, ``nodes/fabric.py``) and of the service range are ever
dialled, from the router namespace: anything else, names and loopback
addresses included, is refused with 403, so the proxy cannot carry traffic
off the machine.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import urllib.parse
from pathlib import Path

from clusters.embedded.podnet import _host

log = logging.getLogger(__name__)

HEAD_LIMIT = 64 * 1024
DIAL_TIMEOUT_S = 5.0  # socket timeout of the upstream connect, as the API server's dial


class ClusterProxy:
    """HTTP CONNECT / forward proxy whose upstream connections start in ``router_netns``.

    ``allowed`` are the only networks dialled.
    """

    def __init__(self, router_netns: str, allowed: tuple[str, ...], *, unix_path: str | Path | None = None,
                 tcp_port: int | None = None):
        self.router = router_netns
        self.allowed = tuple(ipaddress.ip_network(n) for n in allowed)
        self.unix_path = None if unix_path is None else Path(unix_path)
        self.tcp_port = tcp_port
        self._listeners: list[socket.socket] = []
        self._open: set[socket.socket] = set()
        self._threads = _host.Threads("podnet-proxy")
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for s in self._listeners:
            if s.family == socket.AF_INET:
                return s.getsockname()
        return None

    def start(self) -> "ClusterProxy":
        self._stopping.clear()
        if self.unix_path is not None:
            if len(os.fsencode(self.unix_path)) >= 108:  # sun_path
                raise ValueError(f"Unix socket path {self.unix_path} is longer than 107 bytes: "
                                 "give the pod network a shorter state_dir")
            self.unix_path.unlink(missing_ok=True)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(self.unix_path))
            os.chmod(self.unix_path, 0o600)  # root's API server only
            s.listen(128)
            self._listeners.append(s)
        if self.tcp_port is not None:
            self._listeners.append(socket.create_server(("127.0.0.1", self.tcp_port), backlog=128))
        for s in self._listeners:
            self._threads.spawn(self._accept_loop, s)
        return self

    @property
    def threads(self) -> list[threading.Thread]:
        return self._threads.alive()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._open.add(s)

    def _forget(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)
        s.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self._track(conn)
            self._threads.spawn(self._handle, conn)

    def _handle(self, client: socket.socket) -> None:
        upstream = None
        try:
            head, rest = _read_head(client)
            if head is None:
                return
            lines = head.split(b"\r\n")
            parts = lines[0].decode("latin-1").split()
            if len(parts) != 3:
                return _reply(client, 400, "malformed request line")
            method, target, version = parts
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                first = b""
            else:
                url = urllib.parse.urlsplit(target)
                if url.scheme != "http" or not url.hostname:
                    return _reply(client, 400, "only CONNECT or absolute http:// requests")
                host, port = url.hostname, str(url.port or 80)
                path = urllib.parse.urlunsplit(("", "", url.path or "/", url.query, ""))
                # One upstream per client connection: force close so a reused
                # proxy connection never carries a request for another host.
                headers = [h for h in lines[1:] if h and not h.lower().startswith((b"connection:", b"proxy-"))]
                first = b"\r\n".join([f"{method} {path} {version}".encode("latin-1"), *headers,
                                      b"Connection: close", b"", b""])
            ip = self._address(host.strip("[]"))
            if ip is None:
                return _reply(client, 403, f"{host} is not a pod or service address of this cluster")
            def dial() -> socket.socket:
                return socket.create_connection((ip, int(port)), timeout=DIAL_TIMEOUT_S)

            try:
                upstream = _host.in_netns(self.router, dial)
            except OSError as exc:
                return _reply(client, 502, f"dialing {ip}:{port} from the pod network: {exc}")
            upstream.settimeout(None)
            self._track(upstream)
            if method == "CONNECT":
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            upstream.sendall(first + rest)
            splice(client, upstream, "podnet-proxy-copy")
        except (OSError, ValueError) as exc:
            log.debug("proxy connection ended: %s", exc)
        finally:
            if upstream is not None:
                self._forget(upstream)
            self._forget(client)

    def _address(self, host: str) -> str | None:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None  # a name: the cluster's DNS is CoreDNS's, in the pods, not here
        return str(ip) if any(ip in net for net in self.allowed) else None

    def stop(self) -> None:
        """Close the listeners and every open connection; safe to repeat."""
        self._stopping.set()
        with self._lock:
            socks = [*self._listeners, *self._open]
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes accept() and recv() in the worker threads
            except OSError:
                pass
        for s in self._listeners:
            s.close()
        self._listeners.clear()
        if self.unix_path is not None:
            if len(os.fsencode(self.unix_path)) >= 108:  # sun_path
                raise ValueError(f"Unix socket path {self.unix_path} is longer than 107 bytes: "
                                 "give the pod network a shorter state_dir")
            self.unix_path.unlink(missing_ok=True)


def _read_head(conn: socket.socket) -> tuple[bytes | None, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > HEAD_LIMIT:
            raise ValueError("request head too large")
        chunk = conn.recv(4096)
        if not chunk:
            return None, b""
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _reply(conn: socket.socket, code: int, message: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[code]
    body = (message + "\n").encode()
    conn.sendall(f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                 "Connection: close\r\n\r\n".encode() + body)


def splice(client: socket.socket, upstream: socket.socket, name: str) -> None:
    """Copy both ways until both directions end (a thread ``name`` carries upstream to client)."""
    t = threading.Thread(target=copy_stream, args=(upstream, client), daemon=True, name=name)
    t.start()
    copy_stream(client, upstream)
    t.join()  # ends when upstream closes or the owner shuts the sockets


def copy_stream(src: socket.socket, dst: socket.socket) -> None:
    """Copy until EOF, then half-close ``dst`` so the far side sees the end too."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def egress_selector_config(socket_path: str | Path) -> str:
    """kube-apiserver ``--egress-selector-config-file`` content sending "cluster" traffic through the proxy."""
    return ("apiVersion: apiserver.k8s.io/v1beta1\n"
            "kind: EgressSelectorConfiguration\n"
            "egressSelections:\n"
            "- name: cluster\n"
            "  connection:\n"
            "    proxyProtocol: HTTPConnect\n"
            "    transport:\n"
            "      uds:\n"
            f"        udsName: {socket_path}\n")
