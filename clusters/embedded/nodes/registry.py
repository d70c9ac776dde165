"""The registry the real nodes pull from: distribution's ``registry`` on the machine's loopback.

Its storage is a cache shared by every platform (``<cache>/registry/``):
pushes are content-addressed, so an image pushed once is there for every
later ``up``. Nodes reach it as ``127.0.0.1:5000`` in their own namespaces
(``relay.py``); containerd's ``hosts.toml`` sends every registry name there,
so a pull of ``docker.io/library/busybox:1.35.0`` asks this registry for
``library/busybox:1.35.0``, and an image it does not hold is its real 404:
``ErrImagePull`` then ``ImagePullBackOff`` from kubelet. (Names that differ
only in their registry host share a repository here.)

:func:`push` uploads an OCI image layout (``images.py``) with the registry
HTTP API: each blob unless the registry has it, then the manifest under its tag.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def config_yaml(storage: Path, port: int) -> str:
    return f"""\
# distribution registry of an embedded platform's real nodes (clusters/embedded/nodes/registry.py)
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {storage}
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
"""


def repository(name: str) -> tuple[str, str]:
    """(repository, tag) the registry holds ``name`` under, as containerd asks a mirror for it."""
    ref, _, tag = name.rpartition(":")
    if "/" in tag or not ref:
        ref, tag = name, "latest"
    parts = ref.split("/")
    host = "docker.io"
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        host, parts = parts[0], parts[1:]
    if host == "docker.io" and len(parts) == 1:
        parts = ["library", *parts]  # docker.io's official images
    return "/".join(parts), tag


def _request(method: str, url: str, data=None, headers: dict[str, str] | None = None,
             ) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), b""


def has_manifest(base_url: str, name: str, digest: str) -> bool:
    """Whether the registry holds the manifest ``digest`` as ``name``'s tag, with every blob it names."""
    repo, tag = repository(name)
    status, headers, body = _request("GET", f"{base_url}/v2/{repo}/manifests/{tag}",
                                      headers={"Accept": MANIFEST_TYPE})
    if status != 200 or headers.get("Docker-Content-Digest") != digest:
        return False
    manifest = json.loads(body)
    return all(_request("HEAD", f"{base_url}/v2/{repo}/blobs/{d['digest']}")[0] == 200
               for d in [manifest["config"], *manifest["layers"]])


def push(layout: Path, name: str, base_url: str) -> int:
    """Push the OCI image layout directory ``layout`` as ``name``; returns the bytes uploaded (0: all there).

    Each blob goes up in one streamed PUT unless the registry has it already.
    """
    repo, tag = repository(name)
    index = json.loads((layout / "index.json").read_text())

    def blob(digest: str) -> Path:
        return layout / "blobs" / "sha256" / digest.split(":", 1)[1]

    manifest = blob(index["manifests"][0]["digest"]).read_bytes()
    parsed = json.loads(manifest)
    uploaded = 0
    for desc in [parsed["config"], *parsed["layers"]]:
        digest = desc["digest"]
        status, _, _ = _request("HEAD", f"{base_url}/v2/{repo}/blobs/{digest}")
        if status == 200:
            continue
        status, headers, _ = _request("POST", f"{base_url}/v2/{repo}/blobs/uploads/")
        if status != 202:
            raise RuntimeError(f"registry {base_url}: starting an upload to {repo} answered {status}")
        location = headers["Location"]
        if location.startswith("/"):
            location = base_url + location
        sep = "&" if "?" in location else "?"
        size = blob(digest).stat().st_size
        with blob(digest).open("rb") as body:
            status, _, _ = _request("PUT", f"{location}{sep}digest={digest}", body,
                                 {"Content-Type": "application/octet-stream", "Content-Length": str(size)})
        if status != 201:
            raise RuntimeError(f"registry {base_url}: uploading {digest} to {repo} answered {status}")
        uploaded += size
    status, _, _ = _request("PUT", f"{base_url}/v2/{repo}/manifests/{tag}", manifest,
                         {"Content-Type": MANIFEST_TYPE})
    if status != 201:
        raise RuntimeError(f"registry {base_url}: putting the manifest of {repo}:{tag} answered {status}")
    return uploaded
