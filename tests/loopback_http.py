"""One way for the project's tests to serve HTTP on loopback: a threading
server on 127.0.0.1 (a free port) in a daemon thread, shut down and closed
when the block ends. Each test brings its own handler, which is what it
tests against."""
from __future__ import annotations

import contextlib
import http.server
import threading
from typing import Iterator


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[http.server.ThreadingHTTPServer]:
    """Serve ``handler`` on 127.0.0.1 until the block ends; ``server_address[1]`` is its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
