"""The registry's slow path (clusters/embedded/nodes/slowpull.py), spoken to as containerd does:
resolve the tag, fetch the manifest by digest, then the config and every layer."""
from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from clusters.embedded.nodes import images, slowpull

PAD = 256 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = images.write_oci_layout(tmp_path_factory.mktemp("base"), "docker.io/library/busybox:test",
                                   [images.layer_tar({"/bin/sh": (b"#!fake\n", 0o755)})], {"Cmd": ["sh"]})
    srv = slowpull.serve(base.path, 0, pad_bytes=PAD)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", base
    srv.shutdown()
    srv.server_close()


def get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method, headers={"Accept": slowpull.MANIFEST_TYPE})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def pull(url: str, repository: str, tag: str) -> tuple[dict, dict[str, float]]:
    """The manifest and, per blob digest, the seconds its download took; every digest checked."""
    status, headers, _ = get(f"{url}/v2/{repository}/manifests/{tag}", "HEAD")
    assert status == 200, f"resolving {repository}:{tag} answered {status}"
    digest = headers["Docker-Content-Digest"]
    status, _, body = get(f"{url}/v2/{repository}/manifests/{digest}")
    assert status == 200 and "sha256:" + hashlib.sha256(body).hexdigest() == digest
    manifest = json.loads(body)
    took = {}
    for desc in [manifest["config"], *manifest["layers"]]:
        began = time.monotonic()
        status, _, blob = get(f"{url}/v2/{repository}/blobs/{desc['digest']}")
        took[desc["digest"]] = time.monotonic() - began
        assert status == 200 and len(blob) == desc["size"]
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == desc["digest"], "a blob differs from its digest"
    return manifest, took


def test_a_slow_name_is_the_base_image_and_one_layer_of_its_own_sent_over_its_seconds(server) -> None:
    url, base = server
    assert get(f"{url}/v2/")[0] == 200
    manifest, took = pull(url, "slow-pull/1.5/busybox", "n1")
    base_manifest = json.loads((base.path / "blobs/sha256" / base.digest[7:]).read_bytes())
    assert manifest["layers"][:-1] == base_manifest["layers"], "the base image's layers come first, unchanged"
    pad = manifest["layers"][-1]
    assert pad["size"] > PAD
    config = json.loads(get(f"{url}/v2/slow-pull/1.5/busybox/blobs/{manifest['config']['digest']}")[2])
    assert config["rootfs"]["diff_ids"] == [d["digest"] for d in manifest["layers"]]
    assert config["config"]["Cmd"] == ["sh"]
    # Lower bound only: the path is slow by construction, however loaded the machine.
    assert took[pad["digest"]] >= 1.4, f"the added layer came in {took[pad['digest']]:.2f}s, not over 1.5 s"


def test_every_tag_is_a_new_image_and_the_same_tag_the_same_image(server) -> None:
    url, _ = server
    first = pull(url, "slow-pull/0.2/busybox", "a")[0]
    again = pull(url, "slow-pull/0.2/busybox", "a")[0]
    other = pull(url, "slow-pull/0.2/busybox", "b")[0]
    assert first == again
    assert first["layers"][-1]["digest"] != other["layers"][-1]["digest"], "two names share their added layer"
    assert first["layers"][:-1] == other["layers"][:-1]


@pytest.mark.parametrize("path", [
    "/v2/library/busybox/manifests/1.35.0",  # not a slow-pull name
    "/v2/slow-pull/0/busybox/manifests/x",  # no time
    "/v2/slow-pull/99999/busybox/manifests/x",  # beyond MAX_SECONDS
    "/v2/slow-pull/1/busybox/manifests/sha256:" + "0" * 64,  # a digest nothing resolved
    "/v2/slow-pull/1/busybox/blobs/sha256:" + "0" * 64,
    "/v2/library/busybox/blobs/sha256:" + "0" * 64,
])
def test_anything_else_is_the_registry_api_s_404(server, path: str) -> None:
    url, base = server
    status, _, body = get(url + path)
    assert status == 404 and json.loads(body)["errors"][0]["code"].endswith("_UNKNOWN")


def test_base_blobs_are_served_only_under_slow_names(server) -> None:
    url, base = server
    layer = json.loads((base.path / "blobs/sha256" / base.digest[7:]).read_bytes())["layers"][0]["digest"]
    assert get(f"{url}/v2/slow-pull/1/busybox/blobs/{layer}")[0] == 200
    assert get(f"{url}/v2/library/busybox/blobs/{layer}")[0] == 404


def test_the_certification_profiles_slow_pull_image_names_this_path() -> None:
    from core import profile

    template = profile.load().data["kueue"]["slowPullImage"]
    found = slowpull.REFERENCE.match(template.format(seconds=30, nonce="3fe1a2"))
    assert found is not None, template
    assert (found["seconds"], found["image"]) == ("30", "busybox:3fe1a2")


def test_pacing_spreads_the_bytes_over_the_seconds(monkeypatch) -> None:
    now = [0.0]
    sent: list[tuple[float, int]] = []

    def write(chunk: bytes) -> None:
        sent.append((now[0], len(chunk)))
        now[0] += 0.001  # each write takes a millisecond

    monkeypatch.setattr(slowpull.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))  # a clock slept on
    slowpull.paced_write(write, b"x" * (slowpull.CHUNK * 10), 5.0, clock=lambda: now[0])
    assert [n for _, n in sent] == [slowpull.CHUNK] * 10
    assert all(0.5 * i <= t < 0.5 * i + 0.01 for i, (t, _) in enumerate(sent)), sent
    assert now[0] >= 5.0, "the download ends no sooner than its seconds"
