"""What the real nodes reach on the machine's loopback, relayed into their own namespaces.

The API server and the image registry listen on the machine's loopback only.
This process makes, inside each node namespace, one listening socket per
forwarded port (a socket keeps the namespace it was made in) and relays
every connection to the matching loopback port of the machine:

* ``127.0.0.1:6443`` -> the API server: kubelet's kubeconfig names it as on a
  control-plane node, and TLS runs end to end between kubelet and the API
  server;
* ``127.0.0.1:5000`` -> the registry (``registry.py``): containerd's
  ``hosts.toml`` sends every registry name there;
* ``127.0.0.1:5001`` -> the registry's slow path (``slowpull.py``), where
  containerd sends the host ``rayproof.local``.

With ``--expose NS=ADDRESS:PORT=UPSTREAM`` it also listens on ``ADDRESS:PORT``
in namespace ``NS``: the pod network's router address, where the API server
advertises itself (the ``kubernetes`` Service's endpoint), so pods reach the
API server through ``kubernetes.default`` as on any cluster (CoreDNS does).

Nothing listens in the machine's namespace but the API server, the registry
and its slow path themselves.

``python -m clusters.embedded.nodes.relay --netns NS [--netns NS ...] --forward PORT=UPSTREAM [...]
[--expose NS=ADDRESS:PORT=UPSTREAM ...] --ready FILE``
"""
from __future__ import annotations

import argparse
import signal
import socket
import threading
from pathlib import Path
from typing import Sequence

from clusters.embedded.podnet import _host
from clusters.embedded.podnet.proxy import DIAL_TIMEOUT_S, splice

API_SERVER_PORT = 6443  # the API server, as seen from inside a node namespace
REGISTRY_PORT = 5000  # the image registry, as seen from inside a node namespace
SLOW_PULL_PORT = 5001  # the registry's slow path, as seen from inside a node namespace


def listen_in(netns: str, port: int, address: str = "127.0.0.1") -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        s.listen(128)
        return s
    return _host.in_netns(netns, make)


def relay(client: socket.socket, upstream_port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", upstream_port), timeout=DIAL_TIMEOUT_S)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    splice(client, upstream, "relay-copy")
    upstream.close()
    client.close()


def serve(listener: socket.socket, upstream_port: int, threads: _host.Threads) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threads.spawn(relay, client, upstream_port)


def _forward(text: str) -> tuple[int, int]:
    port, _, upstream = text.partition("=")
    try:
        return int(port), int(upstream)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--forward wants PORT=UPSTREAM_PORT, not {text!r}") from None


def _expose(text: str) -> tuple[str, str, int, int]:
    netns, _, rest = text.partition("=")
    address, _, ports = rest.partition(":")
    try:
        port, upstream = _forward(ports)
    except argparse.ArgumentTypeError:
        port = upstream = 0
    if not (netns and address and port and upstream):
        raise argparse.ArgumentTypeError(f"--expose wants NETNS=ADDRESS:PORT=UPSTREAM_PORT, not {text!r}")
    return netns, address, port, upstream


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusters.embedded.nodes.relay", description=__doc__.split("\n")[0])
    ap.add_argument("--netns", action="append", required=True, help="a node's network namespace (repeatable)")
    ap.add_argument("--forward", action="append", type=_forward, required=True,
                    help="PORT=UPSTREAM: 127.0.0.1:PORT in each node to 127.0.0.1:UPSTREAM here (repeatable)")
    ap.add_argument("--expose", action="append", type=_expose, default=[],
                    help="NETNS=ADDRESS:PORT=UPSTREAM: ADDRESS:PORT in NETNS to 127.0.0.1:UPSTREAM here (repeatable)")
    ap.add_argument("--ready", type=Path, required=True, help="file written once every listener is up")
    args = ap.parse_args(argv)
    threads = _host.Threads("relay")
    listeners = [(listen_in(ns, port), upstream) for ns in args.netns for port, upstream in args.forward]
    listeners += [(listen_in(ns, port, address), upstream) for ns, address, port, upstream in args.expose]
    for listener, upstream in listeners:
        threads.spawn(serve, listener, upstream, threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    args.ready.write_text("\n".join(args.netns) + "\n")
    stop.wait()
    for listener, _ in listeners:
        listener.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
