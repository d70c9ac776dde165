"""The registry's slow path: an image whose pull takes as long as its name says (ADM-3's straggler).

A reference ``rayproof.local/slow-pull/<seconds>/<name>:<tag>`` is an image
the real nodes pull through this server: containerd's ``hosts.toml`` sends
the host ``rayproof.local`` to ``127.0.0.1:5001`` in every node namespace,
which the relay (``relay.py``) forwards here. For any repository
``slow-pull/<seconds>/<name>`` and any tag it serves the shell image (the
layers and config of its OCI layout, ``images.py``) with one more layer of
its own: :data:`PAD_BYTES` drawn from the repository and tag, so that every
name is an image no node holds yet, and containerd, which skips only the
blobs it has by digest, downloads that layer. The layer goes out at the pace
that makes its download take ``<seconds>``: a real pull over HTTP, through a
path with little bandwidth, as a straggler's large image on a slow link.
Kubelet reports it as any pull (``Pulling``, then ``Successfully pulled image
... in 30.2s``), and the pod waits in ``Pending`` (``Init:0/1`` for an init
container) meanwhile. The image's default command is busybox's ``sh``,
which exits 0 with nothing on its stdin.

The certification profile's ``kueue.slowPullImage`` names this path
(:data:`REFERENCE` is its form).

``python -m clusters.embedded.nodes.slowpull --base LAYOUT --port PORT``
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence

HOST = "rayproof.local"  # the registry host the nodes send here
# <host>/slow-pull/<seconds>/<name>:<tag>, as pods write it
REFERENCE = re.compile(rf"^{re.escape(HOST)}/slow-pull/(?P<seconds>\d+(?:\.\d+)?)/(?P<image>.+)$")
# The repository containerd asks this server for: slow-pull/<seconds>/<name>
_REPOSITORY = re.compile(r"^slow-pull/(?P<seconds>\d+(?:\.\d+)?)/[a-z0-9]+(?:[._/-][a-z0-9]+)*$")
_PATH = re.compile(r"^/v2/(?P<repo>.+)/(?P<kind>manifests|blobs)/(?P<ref>[A-Za-z0-9_.:+-]+)$")
PAD_BYTES = 8 * 2**20  # the layer every name adds, downloaded at the pace of its seconds
MAX_SECONDS = 3600.0
KEPT_IMAGES = 8  # images held in memory (a pull of one fetches it within seconds of resolving it)
CHUNK = 64 * 1024
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
PAD_PATH = "var/lib/rayproof/slow-pull-pad"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class SlowImage:
    seconds: float
    manifest: bytes
    manifest_digest: str
    blobs: dict[str, bytes]  # its config and its added layer, by digest
    pad_digest: str  # the added layer's (an uncompressed tar)


class Base:
    """The image every slow name extends: an OCI image layout's manifest, config and layers."""

    def __init__(self, layout: Path):
        self.blobs = layout / "blobs" / "sha256"
        index = json.loads((layout / "index.json").read_text())
        self.manifest = json.loads(self.blob(index["manifests"][0]["digest"]))
        self.config = json.loads(self.blob(self.manifest["config"]["digest"]))

    def blob(self, digest: str) -> bytes:
        return (self.blobs / digest.split(":", 1)[1]).read_bytes()

    def has(self, digest: str) -> bool:
        return digest.startswith("sha256:") and (self.blobs / digest[7:]).is_file()

    def extended(self, repository: str, tag: str, seconds: float, pad_bytes: int) -> SlowImage:
        from clusters.embedded.nodes.images import layer_tar

        seed = hashlib.sha256(f"{repository}:{tag}".encode()).digest()
        pad = layer_tar({PAD_PATH: random.Random(seed).randbytes(pad_bytes)})
        config = json.loads(json.dumps(self.config))
        config["rootfs"]["diff_ids"].append(digest_of(pad))
        config.setdefault("history", []).append({"created_by": f"rayproof slow path: {repository}:{tag}"})
        config_blob = json.dumps(config, sort_keys=True).encode()
        manifest = json.loads(json.dumps(self.manifest))
        manifest["config"] = {**manifest["config"], "digest": digest_of(config_blob), "size": len(config_blob)}
        manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest_of(pad),
                                   "size": len(pad)})
        manifest_blob = json.dumps(manifest, sort_keys=True).encode()
        return SlowImage(seconds, manifest_blob, digest_of(manifest_blob),
                         {digest_of(config_blob): config_blob, digest_of(pad): pad}, digest_of(pad))


class Images:
    """The slow images named lately, by (repository, tag), and their blobs by digest."""

    def __init__(self, base: Base, pad_bytes: int = PAD_BYTES):
        self.base, self.pad_bytes = base, pad_bytes
        self._by_name: OrderedDict[tuple[str, str], SlowImage] = OrderedDict()
        self._lock = threading.Lock()

    def named(self, repository: str, tag: str) -> SlowImage | None:
        m = _REPOSITORY.match(repository)
        if not m or not 0 < float(m.group("seconds")) <= MAX_SECONDS:
            return None
        with self._lock:
            image = self._by_name.get((repository, tag))
            if image is None:
                image = self.base.extended(repository, tag, float(m.group("seconds")), self.pad_bytes)
                self._by_name[(repository, tag)] = image
                while len(self._by_name) > KEPT_IMAGES:
                    self._by_name.popitem(last=False)
            self._by_name.move_to_end((repository, tag))
            return image

    def manifest(self, repository: str, reference: str) -> bytes | None:
        if reference.startswith("sha256:"):
            with self._lock:
                found = [i for (repo, _), i in self._by_name.items()
                         if repo == repository and i.manifest_digest == reference]
            return found[0].manifest if found else None
        image = self.named(repository, reference)
        return image.manifest if image else None

    def blob(self, repository: str, digest: str) -> tuple[bytes, float] | None:
        """A blob of ``repository``'s images and the seconds its download is to take (0: at once)."""
        with self._lock:
            for (repo, _), image in self._by_name.items():
                if repo == repository and digest in image.blobs:
                    return image.blobs[digest], image.seconds if digest == image.pad_digest else 0.0
        if _REPOSITORY.match(repository) and self.base.has(digest):
            return self.base.blob(digest), 0.0
        return None


def paced_write(write, data: bytes, seconds: float, clock=time.monotonic) -> None:
    """Write ``data`` in chunks, none ahead of the share of ``seconds`` its offset is of the whole."""
    began = clock()
    for offset in range(0, len(data), CHUNK):
        due = began + seconds * offset / len(data)
        ahead = due - clock()
        if ahead > 0:
            time.sleep(ahead)  # sleep-ok: the slow path's bandwidth, not a wait for anything
        write(data[offset:offset + CHUNK])
    ahead = began + seconds - clock()
    if ahead > 0:
        time.sleep(ahead)  # sleep-ok: the last chunk is due at the end of the download


def handler_for(images: Images) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "rayproof-slow-pull"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def _send(self, status: int, data: bytes, content_type: str, digest: str = "") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            if digest:
                self.send_header("Docker-Content-Digest", digest)
            self.end_headers()

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/v2", "/v2/"):
                self._send(200, b"{}", "application/json")
                if body:
                    self.wfile.write(b"{}")
                return
            m = _PATH.match(path)
            if m and m.group("kind") == "manifests":
                data = images.manifest(m.group("repo"), m.group("ref"))
                if data is not None:
                    self._send(200, data, MANIFEST_TYPE, digest_of(data))
                    if body:
                        self.wfile.write(data)
                    return
                return self._unknown("MANIFEST_UNKNOWN", f"no slow image {m.group('repo')}:{m.group('ref')}", body)
            if m:
                found = images.blob(m.group("repo"), m.group("ref"))
                if found is not None:
                    data, seconds = found
                    self._send(200, data, "application/octet-stream", m.group("ref"))
                    if body:
                        began = time.monotonic()
                        paced_write(self.wfile.write, data, seconds)
                        if seconds:
                            self.log_message("sent %s (%d bytes) in %.1fs", m.group("ref"), len(data),
                                             time.monotonic() - began)
                    return
                return self._unknown("BLOB_UNKNOWN", f"no blob {m.group('ref')} in {m.group('repo')}", body)
            self._unknown("NAME_UNKNOWN", f"not a slow-pull path: {path}", body)

        def _unknown(self, code: str, message: str, body: bool) -> None:
            data = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
            self._send(404, data, "application/json")
            if body:
                self.wfile.write(data)

    return Handler


def serve(base: Path, port: int, host: str = "127.0.0.1", pad_bytes: int = PAD_BYTES) -> ThreadingHTTPServer:
    """The slow path's server (not yet serving: call ``serve_forever``)."""
    server = ThreadingHTTPServer((host, port), handler_for(Images(Base(base), pad_bytes)))
    server.daemon_threads = True
    return server


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusters.embedded.nodes.slowpull", description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="OCI image layout of the image every slow name extends")
    ap.add_argument("--port", type=int, required=True, help="loopback port to listen on")
    args = ap.parse_args(argv)
    server = serve(args.base, args.port)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
