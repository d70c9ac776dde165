"""The node's kubelet API over HTTPS: what ``kubectl logs`` reaches through the API server.

The API server serves ``GET /api/v1/namespaces/<ns>/pods/<pod>/log`` by
calling the node at ``status.addresses[InternalIP]`` and
``status.daemonEndpoints.kubeletEndpoint.Port``:
``GET /containerLogs/<ns>/<pod>/<container>?follow=&previous=&tailLines=&limitBytes=``.
This server answers that (plus ``/healthz`` and ``/pods``) on 127.0.0.1 with
the node's serving certificate (issued by the cluster CA, SANs 127.0.0.1 and
the node name, so the API server's ``--kubelet-certificate-authority`` check
passes).

Authentication is by client certificate: with a CA configured the TLS
handshake requires a certificate signed by it, and only the API server's
kubelet-client identity (``kube-apiserver-kubelet-client``) or a
``system:masters`` member is then authorised -- the upstream kubelet
delegates this to the API server (webhook authn/authz); here it is a fixed
rule. ``exec``, ``attach``, ``portForward``, ``sinceSeconds``/``sinceTime``
and ``timestamps`` are not served (the log files carry no per-line times).
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from clusters.embedded.nodeagent.containers import ContainerInstance

ALLOWED_CLIENTS = ("kube-apiserver-kubelet-client",)
ALLOWED_GROUPS = ("system:masters",)
FOLLOW_POLL_S = 0.25
CHUNK = 65536

# (namespace, pod name) -> the pod's worker (or None)
Lookup = Callable[[str, str], Any]


def tail_offset(path: Path, lines: int) -> int:
    """Byte offset where the last ``lines`` lines of ``path`` begin (a final
    newline does not start another line)."""
    size = os.path.getsize(path)
    if lines <= 0:
        return size
    with open(path, "rb") as fh:
        pos, data = size, b""
        while pos > 0:
            step = min(CHUNK, pos)
            pos -= step
            fh.seek(pos)
            data = fh.read(step) + data
            body = data[:-1] if data.endswith(b"\n") else data
            if body.count(b"\n") >= lines:
                idx = len(body)
                for _ in range(lines):
                    idx = body.rfind(b"\n", 0, idx)
                return pos + idx + 1
    return 0


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.0"  # streamed bodies end when the connection closes

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the API server retries and logs
        pass

    def _send(self, code: int, body: str, ctype: str = "text/plain; charset=utf-8") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        if not self.server.require_client_cert:
            return True
        cert = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
        if not cert:
            self._send(401, "Unauthorized")
            return False
        subject = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
        orgs = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "organizationName"]
        if subject.get("commonName") in ALLOWED_CLIENTS or any(o in ALLOWED_GROUPS for o in orgs):
            return True
        self._send(403, f"Forbidden (user={subject.get('commonName')}, verb=get, resource=nodes, subresource=proxy)")
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if not self._authorised():
            return
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if parts == ["healthz"]:
            self._send(200, "ok")
        elif parts == ["pods"]:
            self._send(200, json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {},
                                        "items": self.server.list_pods()}), "application/json")
        elif len(parts) == 4 and parts[0] == "containerLogs":
            self._logs(parts[1], parts[2], parts[3], query)
        elif parts and parts[0] in ("exec", "attach", "portForward", "run"):
            self._send(501, f"{parts[0]} is not supported by the rayproof node agent")
        else:
            self._send(404, "404 page not found")

    def _logs(self, ns: str, pod: str, container: str, q: dict[str, list[str]]) -> None:
        flag = lambda k: (q.get(k) or ["false"])[0].lower() in ("true", "1")  # noqa: E731
        worker = self.server.lookup(ns, pod)
        if worker is None:
            self._send(404, f'pod "{pod}" not found on node {self.server.node}')
            return
        path, inst, error = worker.log_path(container, flag("previous"))
        if path is None:
            self._send(400, error)
            return
        tail = q.get("tailLines")
        limit = int(q["limitBytes"][0]) if q.get("limitBytes") else None
        try:
            offset = tail_offset(path, int(tail[0])) if tail else 0
        except FileNotFoundError:
            offset = 0
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        sent = 0
        follow = flag("follow") and inst is not None
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                while True:
                    block = fh.read(CHUNK)
                    if block:
                        if limit is not None:
                            block = block[: max(0, limit - sent)]
                        self.wfile.write(block)
                        sent += len(block)
                        if limit is not None and sent >= limit:
                            return
                        continue
                    if not follow or self.server.stopping.is_set():
                        return
                    assert isinstance(inst, ContainerInstance)
                    if inst.exited.is_set():
                        follow = False  # drain what the container wrote last, then end
                        continue
                    self.wfile.flush()
                    inst.exited.wait(FOLLOW_POLL_S)  # sleep-ok: follow pacing; ends when the container exits
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            return


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], node: str, lookup: Lookup, list_pods: Callable[[], list],
                 ctx: ssl.SSLContext, require_client_cert: bool):
        self.node = node
        self.lookup = lookup
        self.list_pods = list_pods
        self.ctx = ctx
        self.require_client_cert = require_client_cert
        self.stopping = threading.Event()
        super().__init__(addr, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        sock.settimeout(30)
        # The handshake happens on the handler's thread (first read), so a slow
        # client never holds up accept().
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # failed handshakes (e.g. a client without a certificate) are the client's problem


class KubeletServer:
    """The read-only kubelet API of one node."""

    def __init__(self, node: str, port: int, cert_file: str, key_file: str, ca_file: str | None,
                 lookup: Lookup, list_pods: Callable[[], list], host: str = "127.0.0.1"):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert_file, key_file)
        if ca_file:
            ctx.load_verify_locations(ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        self.node = node
        self.server = _Server((host, port), node, lookup, list_pods, ctx, require_client_cert=bool(ca_file))
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"kubelet-api-{node}", daemon=True)

    def start(self) -> "KubeletServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.stopping.set()
        self.server.shutdown()
        self.server.server_close()
