"""Container probes (startup, liveness, readiness), as the kubelet's prober workers run them.

One :class:`ProbeWorker` thread per probe of a running container instance:
it waits ``initialDelaySeconds`` from the container's start, then probes every
``periodSeconds`` with ``timeoutSeconds``, and flips its result only after
``successThreshold`` consecutive successes or ``failureThreshold`` consecutive
failures. Initial results are the kubelet's: readiness starts *failed* (not
ready), liveness starts *successful*, startup starts unknown; liveness and
readiness do not run until the startup probe has succeeded.

Handlers:

* ``exec`` -- the command inside the container (its namespaces, cgroup and
  environment), success iff exit 0; a timeout is a failure;
* ``httpGet`` -- from inside the pod's network namespace to ``host`` (default
  the pod IP) and the (possibly named) port; success iff 200 <= status < 400;
* ``tcpSocket`` -- a TCP connect from inside the pod's network namespace.

``grpc`` probes are not supported and always fail, saying so.
"""
from __future__ import annotations

import ctypes
import http.client
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from clusters.embedded.nodeagent.containers import ContainerInstance

_CLONE_NEWNET = 0x40000000
PROBE_USER_AGENT = "kube-probe/1.35"
_libc = ctypes.CDLL(None, use_errno=True)


def netns_socket(netns: str | None, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket that lives in network namespace ``netns`` (None: this one).

    setns(CLONE_NEWNET) changes only the calling thread, and a socket stays in
    the namespace it was made in; so a short-lived helper thread joins the pod's
    namespace, makes the socket and ends, and no agent thread ever changes
    namespace.
    """
    if not netns:
        return socket.socket(family, kind)
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["sock"] = socket.socket(family, kind)
        except BaseException as exc:  # handed back to the caller
            box["error"] = exc

    t = threading.Thread(target=body, name=f"netns-socket-{netns}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["sock"]


class _NetnsHTTPConnection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, netns: str | None, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._netns = netns

    def connect(self) -> None:
        sock = netns_socket(self._netns)
        sock.settimeout(self.timeout)
        sock.connect((self.host, self.port))
        self.sock = sock


class _NetnsHTTPSConnection(_NetnsHTTPConnection):
    def connect(self) -> None:
        super().connect()
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the kubelet skips verification for probes
        self.sock = ctx.wrap_socket(self.sock, server_hostname=self.host)


def resolve_port(port: Any, container: Mapping[str, Any]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} not found in container {container.get('name')!r}")


@dataclass
class ProbeOutcome:
    success: bool
    message: str = ""


def run_probe(probe: Mapping[str, Any], container: Mapping[str, Any], instance: ContainerInstance,
              netns: str | None, pod_ip: str | None) -> ProbeOutcome:
    """Run one probe once."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    if probe.get("exec"):
        rc, out = instance.exec(list(probe["exec"].get("command") or []), timeout)
        if rc is None:
            return ProbeOutcome(False, f"command timed out: {out}")
        return ProbeOutcome(rc == 0, out.strip()[:1024] if rc != 0 else "")
    try:
        if probe.get("httpGet"):
            hg = probe["httpGet"]
            host = hg.get("host") or pod_ip or "127.0.0.1"
            port = resolve_port(hg.get("port"), container)
            cls = _NetnsHTTPSConnection if (hg.get("scheme") or "HTTP").upper() == "HTTPS" else _NetnsHTTPConnection
            conn = cls(host, port, netns, timeout)
            try:
                headers = {"User-Agent": PROBE_USER_AGENT, "Accept": "*/*"}
                for h in hg.get("httpHeaders") or []:
                    headers[h["name"]] = h["value"]
                conn.request("GET", hg.get("path") or "/", headers=headers)
                resp = conn.getresponse()
                resp.read(10240)
                if 200 <= resp.status < 400:
                    return ProbeOutcome(True)
                return ProbeOutcome(False, f"HTTP probe failed with statuscode: {resp.status}")
            finally:
                conn.close()
        if probe.get("tcpSocket"):
            ts = probe["tcpSocket"]
            host = ts.get("host") or pod_ip or "127.0.0.1"
            sock = netns_socket(netns)
            try:
                sock.settimeout(timeout)
                sock.connect((host, resolve_port(ts.get("port"), container)))
                return ProbeOutcome(True)
            finally:
                sock.close()
        if probe.get("grpc"):
            return ProbeOutcome(False, "grpc probes are not supported by the rayproof node agent")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ProbeOutcome(False, _dial_error(probe, pod_ip, container, exc))
    return ProbeOutcome(False, "probe has no handler")


def _dial_error(probe: Mapping[str, Any], pod_ip: str | None, container: Mapping[str, Any],
                exc: BaseException) -> str:
    """The probe failure in the words of Go's net/http, as upstream's Unhealthy events say it."""
    handler = probe.get("httpGet") or probe.get("tcpSocket") or {}
    host = handler.get("host") or pod_ip or "127.0.0.1"
    try:
        port = resolve_port(handler.get("port"), container)
    except ValueError as err:
        return str(err)
    what = {ConnectionRefusedError: "connect: connection refused", TimeoutError: "i/o timeout",
            socket.timeout: "i/o timeout"}.get(type(exc), str(exc))
    dial = f"dial tcp {host}:{port}: {what}"
    if probe.get("httpGet"):
        scheme = (handler.get("scheme") or "HTTP").lower()
        return f'Get "{scheme}://{host}:{port}{handler.get("path") or "/"}": {dial}'
    return dial


class ProbeWorker:
    """Runs one probe of one container instance until stopped."""

    def __init__(self, kind: str, probe: Mapping[str, Any], container: Mapping[str, Any],
                 instance: ContainerInstance, netns: str | None, pod_ip: str | None,
                 on_change: Callable[["ProbeWorker"], None], gate: Callable[[], bool] | None = None):
        self.kind = kind  # startup | liveness | readiness
        self.probe = probe
        self.container = container
        self.instance = instance
        self.netns = netns
        self.pod_ip = pod_ip
        self.on_change = on_change
        self.gate = gate  # liveness/readiness wait until startup succeeded
        self.result: bool | None = {"readiness": False, "liveness": True, "startup": None}[kind]
        self.last_message = ""
        self._successes = 0
        self._failures = 0
        self._stop = threading.Event()
        self._poke = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"probe-{kind}-{container['name']}-{instance.restart}")

    @property
    def period(self) -> float:
        return float(self.probe.get("periodSeconds") or 10)

    def start(self) -> "ProbeWorker":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()

    def poke(self) -> None:
        """Run the next probe now (the startup probe just succeeded)."""
        self._poke.set()

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stopped/poked; True when stopped."""
        self._poke.wait(max(seconds, 0.0))  # sleep-ok: prober period pacing, ended early by stop()/poke()
        self._poke.clear()
        return self._stop.is_set() or self.instance.exited.is_set()

    def _loop(self) -> None:
        if self._pause(float(self.probe.get("initialDelaySeconds") or 0)):
            return
        success_threshold = int(self.probe.get("successThreshold") or 1)
        failure_threshold = int(self.probe.get("failureThreshold") or 3)
        while not self._stop.is_set() and not self.instance.exited.is_set():
            if self.gate is not None and not self.gate():
                if self._pause(self.period):
                    return
                continue
            outcome = run_probe(self.probe, self.container, self.instance, self.netns, self.pod_ip)
            if self._stop.is_set() or self.instance.exited.is_set():
                return
            changed = False
            if outcome.success:
                self._successes += 1
                self._failures = 0
                if self.result is not True and self._successes >= success_threshold:
                    self.result, changed = True, True
            else:
                self._failures += 1
                self._successes = 0
                self.last_message = outcome.message
                if self.result is not False and self._failures >= failure_threshold:
                    self.result, changed = False, True
            if changed or (not outcome.success):
                # failures are reported every time (the Unhealthy event), changes always
                self.on_change(self)
            if self.kind == "startup" and self.result is True:
                return  # a startup probe stops once it has succeeded
            if self.kind == "liveness" and self.result is False:
                return  # the container is about to be killed
            if self._pause(self.period):
                return
