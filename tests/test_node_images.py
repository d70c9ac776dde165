"""The real nodes' images: OCI image layouts that containerd imports (checked here without containerd)."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from clusters.embedded.nodes import images


def _blobs(archive: Path) -> tuple[dict, dict[str, bytes]]:
    with tarfile.open(archive) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    return json.loads(files["index.json"]), {n.rsplit("/", 1)[1]: b for n, b in files.items() if n.startswith("blobs/")}


def test_an_archive_is_a_content_addressed_oci_layout_naming_its_image(tmp_path: Path) -> None:
    layer = images.layer_tar({"/hello": (b"#!/bin/sh\necho hi\n", 0o755)}, dirs=["/tmp"], symlinks={"/hi": "/hello"})
    made = images.write_oci_archive(tmp_path / "a.tar", "example.test/hello:1", [layer], {"Cmd": ["/hello"]})
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
    again = images.write_oci_archive(tmp_path / "b.tar", "example.test/hello:1", [layer], {"Cmd": ["/hello"]})
    assert again.digest == made.digest  # the same inputs make the same image


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
