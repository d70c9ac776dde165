"""The real nodes' images: OCI image layouts that containerd imports (checked here without containerd)."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from clusters.embedded.nodes import images


def _blobs(layout: Path) -> tuple[dict, dict[str, bytes]]:
    blobs = {p.name: p.read_bytes() for p in (layout / "blobs" / "sha256").iterdir()}
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    return json.loads((layout / "index.json").read_text()), blobs


def test_a_layout_is_content_addressed_and_names_its_image(tmp_path: Path) -> None:
    layer = images.layer_tar({"/hello": (b"#!/bin/sh\necho hi\n", 0o755)}, dirs=["/tmp"], symlinks={"/hi": "/hello"})
    made = images.write_oci_layout(tmp_path / "a", "example.test/hello:1", [layer], {"Cmd": ["/hello"]})
    index, blobs = _blobs(made.path)
    assert all(hashlib.sha256(data).hexdigest() == name for name, data in blobs.items())  # content-addressed
    entry, = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "example.test/hello:1"
    assert entry["digest"] == made.digest
    manifest = json.loads(blobs[entry["digest"].split(":")[1]])
    config = json.loads(blobs[manifest["config"]["digest"].split(":")[1]])
    assert config["rootfs"]["diff_ids"] == [d["digest"] for d in manifest["layers"]]  # uncompressed layers
    with tarfile.open(fileobj=io.BytesIO(blobs[manifest["layers"][0]["digest"].split(":")[1]])) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["hello"].mode == 0o755 and members["hi"].issym() and members["tmp"].mode == 0o1777
    again = images.write_oci_layout(tmp_path / "b", "example.test/hello:1", [layer], {"Cmd": ["/hello"]})
    assert again.digest == made.digest  # the same inputs make the same image


def test_a_layer_given_as_a_file_is_moved_into_the_layout_under_its_digest(tmp_path: Path) -> None:
    layer = images.layer_tar({"/big": b"x" * 4096})
    (tmp_path / "layer.tar").write_bytes(layer)
    from_file = images.write_oci_layout(tmp_path / "f", "example.test/big:1", [tmp_path / "layer.tar"], {})
    from_bytes = images.write_oci_layout(tmp_path / "b", "example.test/big:1", [layer], {})
    assert from_file.digest == from_bytes.digest and not (tmp_path / "layer.tar").exists()
    assert (from_file.path / "blobs" / "sha256" / hashlib.sha256(layer).hexdigest()).read_bytes() == layer


def test_a_dynamically_linked_binary_is_refused_for_an_image_of_one_file() -> None:
    assert images._elf_interpreter(Path("/bin/ls").read_bytes())  # Debian's ls needs ld.so and libc
    with pytest.raises(ValueError):
        images._elf_interpreter(b"#!/bin/sh\n")


@pytest.mark.parametrize(("name", "expected"), [
    ("docker.io/library/busybox:1.35.0", ("library/busybox", "1.35.0")),
    ("busybox:1.35.0", ("library/busybox", "1.35.0")),
    ("rayproject/ray:2.60.0", ("rayproject/ray", "2.60.0")),
    ("registry.k8s.io/pause:3.10.1", ("pause", "3.10.1")),
    ("localhost:5000/team/app", ("team/app", "latest")),
])
def test_an_image_name_maps_to_the_repository_containerd_asks_a_mirror_for(name, expected) -> None:
    from clusters.embedded.nodes.registry import repository

    assert repository(name) == expected


def test_the_ray_images_environment_is_what_ray_and_torch_need_and_nothing_of_the_suites_own() -> None:
    from clusters.embedded.nodes import rayimage

    names = {d.name for d in rayimage.closure()}
    # Ray's extras (train: pyarrow; serve: fastapi, uvicorn), torch's CUDA libraries and Triton.
    assert {"ray", "torch", "pyarrow", "fastapi", "uvicorn", "triton", "nvidia-nccl-cu13"} <= names, sorted(names)
    assert not names & {"pytest", "kubernetes", "chaostoolkit", "rayproof"}, sorted(names)


def test_the_ray_images_environment_layer_installs_as_pip_does_on_debian(tmp_path: Path) -> None:
    """Distributions land in Debian's site directory, scripts in /usr/local/bin run Debian's Python."""
    from clusters.embedded.nodes import rayimage

    dists = rayimage.closure(("six", "charset-normalizer"))
    assert [d.name for d in dists] == ["charset-normalizer", "six"]
    size = rayimage._env_layer(tmp_path / "env.tar", dists, progress=lambda _: None)
    with tarfile.open(tmp_path / "env.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
        script = tar.extractfile(members["usr/local/bin/normalizer"]).read()
        six = tar.extractfile(members[f"{rayimage.SITE}/six.py"]).read()
    assert six == Path(next(d.dist for d in dists if d.name == "six").locate_file("six.py")).read_bytes()
    assert script.startswith(b"#!/usr/bin/python3.11\n") and members["usr/local/bin/normalizer"].mode == 0o755
    assert members["usr/local/bin/python"].issym() and members["usr/local/bin/python"].linkname == "/usr/bin/python3.11"
    assert all(m.mtime == 0 and m.uid == 0 for m in members.values())  # the same files make the same layer
    assert size == sum(m.size for m in members.values() if m.isfile())


def test_a_debian_layers_package_version_comes_from_its_dpkg_database(tmp_path: Path) -> None:
    status = (b"Package: libc6\nStatus: install ok installed\nVersion: 2.36-9+deb12u14\n\n"
              b"Package: redis-server\nStatus: install ok installed\nDescription: Persistent key-value database\n"
              b" Version: 9.9 (a description line, not the field)\nVersion: 5:7.0.15-1~deb12u6\n")
    (tmp_path / "layer.tar").write_bytes(images.layer_tar({"/var/lib/dpkg/status": status}))
    assert images.package_version(tmp_path / "layer.tar", "redis-server") == "5:7.0.15-1~deb12u6"
    with pytest.raises(LookupError):
        images.package_version(tmp_path / "layer.tar", "python3.11")
