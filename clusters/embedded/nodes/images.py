"""Container images the real nodes start from, built here as OCI image archives.

Each image is one uncompressed layer of files this machine already has (no
network): the sandbox image ``registry.k8s.io/pause:3.10.1`` holds the
``pause`` program built with the platform (``build.py``), and the shell image
``docker.io/library/busybox:<version>`` holds Debian's static busybox with one
link per applet. Archives are written once per content key under
``<cache>/images/`` and pushed to the nodes' registry (``registry.py``),
from which every node pulls them as any node pulls its images.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from clusters.embedded import build

PAUSE_IMAGE = build.load_versions()["pause"]["image"]  # the sandbox image containerd is told to use
BUSYBOX = Path("/bin/busybox")
# Bump when the archives' layout changes, so old cached archives are not reused.
RECIPE = "1"
_EPOCH = 0  # every file's mtime in a layer: same inputs, same digest


@dataclass(frozen=True)
class ImageArchive:
    name: str  # the reference pods use, e.g. docker.io/library/busybox:1.35.0
    path: Path  # an OCI image layout in a tar, for `ctr images import`
    digest: str  # the manifest's digest (what kubelet reports as imageID)


def _tar_info(name: str, *, kind: bytes = tarfile.REGTYPE, size: int = 0, mode: int = 0o644,
              link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.linkname, info.mtime = kind, size, mode, link, _EPOCH
    info.uid = info.gid = 0
    return info


def layer_tar(files: Mapping[str, bytes | tuple[bytes, int]], dirs: Sequence[str] = (),
              symlinks: Mapping[str, str] | None = None) -> bytes:
    """An uncompressed layer: ``files`` (path -> bytes or (bytes, mode)), directories, symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            tar.addfile(_tar_info(d.lstrip("/"), kind=tarfile.DIRTYPE, mode=0o1777 if d == "/tmp" else 0o755))
        for path in sorted(files):
            value = files[path]
            data, mode = value if isinstance(value, tuple) else (value, 0o644)
            tar.addfile(_tar_info(path.lstrip("/"), size=len(data), mode=mode), io.BytesIO(data))
        for path, target in sorted((symlinks or {}).items()):
            tar.addfile(_tar_info(path.lstrip("/"), kind=tarfile.SYMTYPE, mode=0o777, link=target))
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def write_oci_archive(dest: Path, name: str, layers: Sequence[bytes], config: Mapping[str, object]) -> ImageArchive:
    """Write an OCI image layout tar holding one linux/amd64 image called ``name``."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    layer_blobs = [_blob(layer) for layer in layers]
    image_config = {
        "architecture": arch, "os": "linux", "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [d for d, _ in layer_blobs]},
        "history": [{"created_by": "rayproof clusters/embedded/nodes/images.py"} for _ in layer_blobs],
    }
    cfg_digest, cfg_bytes = _blob(json.dumps(image_config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest,
                   "size": len(cfg_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": len(b)}
                   for d, b in layer_blobs],
    }
    man_digest, man_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": manifest["mediaType"], "digest": man_digest, "size": len(man_bytes),
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(path: str, data: bytes) -> None:
            tar.addfile(_tar_info(path, size=len(data)), io.BytesIO(data))
        add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add("index.json", json.dumps(index, sort_keys=True).encode())
        for digest, data in [(cfg_digest, cfg_bytes), (man_digest, man_bytes), *layer_blobs]:
            add("blobs/sha256/" + digest.split(":", 1)[1], data)
    os.replace(tmp, dest)
    return ImageArchive(name, dest, man_digest)


def busybox_version() -> str:
    """Debian's busybox-static version (``1.35.0``), which tags the shell image."""
    if not BUSYBOX.is_file():
        raise FileNotFoundError(f"{BUSYBOX} is missing: the real nodes' shell image is made from Debian's "
                                "busybox-static (apt-get install -y busybox-static; bin/rayproof does it as root)")
    if _elf_interpreter(BUSYBOX.read_bytes()):
        raise RuntimeError(f"{BUSYBOX} is dynamically linked (Debian's busybox, not busybox-static): an image "
                           "holding it alone could not start; apt-get install -y busybox-static")
    head = subprocess.run([str(BUSYBOX)], capture_output=True, text=True).stdout.splitlines()
    words = head[0].split() if head else []
    return words[1].lstrip("v").split("-")[0] if len(words) > 1 else "unknown"


def _elf_interpreter(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF file names a program interpreter (is dynamically linked)."""
    import struct

    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    return any(struct.unpack_from("<I", elf, phoff + i * phentsize)[0] == 3 for i in range(phnum))  # PT_INTERP


def _busybox_layer() -> bytes:
    applets = subprocess.run([str(BUSYBOX), "--list-full"], capture_output=True, text=True,
                             check=True).stdout.split()
    links = {"/" + a: "/bin/busybox" for a in applets if a != "bin/busybox"}
    files: dict[str, bytes | tuple[bytes, int]] = {
        "/bin/busybox": (BUSYBOX.read_bytes(), 0o755),
        "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        "/etc/group": b"root:x:0:\nnogroup:x:65534:\n",
    }
    dirs = ["/bin", "/sbin", "/usr", "/usr/bin", "/usr/sbin", "/etc", "/tmp", "/root", "/proc", "/sys", "/dev",
            "/var", "/home"]
    return layer_tar(files, dirs, links)


def ensure_images(cache: Path, pause_binary: Path, progress=print) -> list[ImageArchive]:
    """The node images as OCI archives under ``cache`` (built once per content)."""
    version = busybox_version()
    key_src = hashlib.sha256()
    for part in (RECIPE.encode(), pause_binary.read_bytes(), BUSYBOX.read_bytes()):
        key_src.update(hashlib.sha256(part).digest())
    root = cache / key_src.hexdigest()[:16]
    busybox_name = f"docker.io/library/busybox:{version}"
    wanted = {PAUSE_IMAGE: root / "pause.oci.tar", busybox_name: root / "busybox.oci.tar"}
    index = root / "images.json"
    if index.is_file() and all(p.is_file() for p in wanted.values()):
        recorded = json.loads(index.read_text())
        return [ImageArchive(n, wanted[n], recorded[n]) for n in wanted]
    t0 = time.monotonic()
    pause = write_oci_archive(wanted[PAUSE_IMAGE], PAUSE_IMAGE,
                              [layer_tar({"/pause": (pause_binary.read_bytes(), 0o755)})],
                              {"Entrypoint": ["/pause"], "User": "65535:65535"})
    shell = write_oci_archive(wanted[busybox_name], busybox_name, [_busybox_layer()],
                              {"Cmd": ["sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]})
    index.write_text(json.dumps({a.name: a.digest for a in (pause, shell)}, indent=1))
    size = sum(p.stat().st_size for p in wanted.values())
    progress(f"node images built in {time.monotonic() - t0:.1f}s ({size / 2**20:.1f} MiB): {', '.join(wanted)}")
    return [pause, shell]
