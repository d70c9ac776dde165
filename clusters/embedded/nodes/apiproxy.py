"""The API server as the real nodes see it: ``127.0.0.1:6443`` inside every node's network namespace.

The API server listens on the machine's loopback only. This process makes
one listening socket inside each node namespace (a socket keeps the namespace
it was made in) and relays every connection to the API server's loopback
port, so kubelet's kubeconfig names ``https://127.0.0.1:6443`` as on a
control-plane node, and TLS runs end to end between kubelet and the API
server. Nothing listens in the machine's namespace but the API server itself.

``python -m clusters.embedded.nodes.apiproxy --upstream-port PORT --netns NS [--netns NS ...] --ready FILE``
"""
from __future__ import annotations

import argparse
import signal
import socket
import threading
from pathlib import Path
from typing import Sequence

from clusters.embedded.nodes.node import API_SERVER_PORT
from clusters.embedded.podnet import _host
from clusters.embedded.podnet.proxy import DIAL_TIMEOUT_S, copy_stream


def listen_in(netns: str, port: int = API_SERVER_PORT) -> socket.socket:
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
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
    t = threading.Thread(target=copy_stream, args=(upstream, client), daemon=True, name="apiproxy-copy")
    t.start()
    copy_stream(client, upstream)
    t.join()
    upstream.close()
    client.close()


def serve(listener: socket.socket, upstream_port: int, threads: _host.Threads) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threads.spawn(relay, client, upstream_port)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusters.embedded.nodes.apiproxy", description=__doc__.split("\n")[0])
    ap.add_argument("--upstream-port", type=int, required=True, help="the API server's port on 127.0.0.1")
    ap.add_argument("--netns", action="append", required=True, help="a node's network namespace (repeatable)")
    ap.add_argument("--ready", type=Path, required=True, help="file written once every listener is up")
    args = ap.parse_args(argv)
    threads = _host.Threads("apiproxy")
    listeners = [listen_in(ns) for ns in args.netns]
    for listener in listeners:
        threads.spawn(serve, listener, args.upstream_port, threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    args.ready.write_text("\n".join(args.netns) + "\n")
    stop.wait()
    for listener in listeners:
        listener.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
