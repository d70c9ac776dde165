"""Container images the real nodes start from, built here as OCI image layouts.

Each image is one uncompressed layer of files this machine already has (no
network): the sandbox image ``registry.k8s.io/pause:3.10.1`` holds the
``pause`` program built with the platform (``build.py``), and the shell image
``docker.io/library/busybox:<version>`` holds Debian's static busybox with one
link per applet. OCI image layouts are written once per content key under
``<cache>/images/`` and pushed to the nodes' registry (``registry.py``),
from which every node pulls them as any node pulls its images. (The Ray
image, gigabytes, is ``rayimage.py``.)
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from clusters.embedded import build

PAUSE_IMAGE = build.load_versions()["pause"]["image"]  # the sandbox image containerd is told to use
BUSYBOX = Path("/bin/busybox")
# Bump when the images' layout changes, so old cached layouts are not reused.
RECIPE = "2"
_EPOCH = 0  # every file's mtime in a layer: same inputs, same digest


@dataclass(frozen=True)
class ImageLayout:
    name: str  # the reference pods use, e.g. docker.io/library/busybox:1.35.0
    path: Path  # an OCI image layout directory (oci-layout, index.json, blobs/sha256/)
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


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def write_oci_layout(dest: Path, name: str, layers: Sequence[bytes | Path], config: Mapping[str, object],
                     ) -> ImageLayout:
    """Write an OCI image layout directory holding one linux/amd64 image called ``name``.

    A layer is the tar's bytes, or the path of a tar file, which is moved
    into the layout (a layer of gigabytes is never held in memory).
    """
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put_bytes(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        (blobs / digest[7:]).write_bytes(data)
        return digest, len(data)

    def put_layer(layer: bytes | Path) -> tuple[str, int]:
        if isinstance(layer, bytes):
            return put_bytes(layer)
        digest, size = _file_digest(layer), layer.stat().st_size
        os.replace(layer, blobs / digest[7:])
        return digest, size

    layer_blobs = [put_layer(layer) for layer in layers]
    image_config = {
        "architecture": arch, "os": "linux", "config": dict(config),
        "rootfs": {"type": "layers", "diff_ids": [d for d, _ in layer_blobs]},
        "history": [{"created_by": "rayproof clusters/embedded/nodes/images.py"} for _ in layer_blobs],
    }
    cfg_digest, cfg_size = put_bytes(json.dumps(image_config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": n}
                   for d, n in layer_blobs],
    }
    man_digest, man_size = put_bytes(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": manifest["mediaType"], "digest": man_digest, "size": man_size,
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (dest / "index.json").write_text(json.dumps(index, sort_keys=True))
    return ImageLayout(name, dest, man_digest)


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


def ensure_images(cache: Path, pause_binary: Path, progress=print) -> list[ImageLayout]:
    """The small node images (sandbox, shell) as OCI layouts under ``cache`` (built once per content)."""
    version = busybox_version()
    key_src = hashlib.sha256()
    for part in (RECIPE.encode(), pause_binary.read_bytes(), BUSYBOX.read_bytes()):
        key_src.update(hashlib.sha256(part).digest())
    root = cache / key_src.hexdigest()[:16]
    busybox_name = f"docker.io/library/busybox:{version}"
    wanted = {PAUSE_IMAGE: root / "pause", busybox_name: root / "busybox"}
    index = root / "images.json"
    if index.is_file():
        recorded = json.loads(index.read_text())
        return [ImageLayout(n, wanted[n], recorded[n]) for n in wanted]
    t0 = time.monotonic()
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    pause = write_oci_layout(partial / "pause", PAUSE_IMAGE,
                             [layer_tar({"/pause": (pause_binary.read_bytes(), 0o755)})],
                             {"Entrypoint": ["/pause"], "User": "65535:65535"})
    shell = write_oci_layout(partial / "busybox", busybox_name, [_busybox_layer()],
                             {"Cmd": ["sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]})
    (partial / "images.json").write_text(json.dumps({a.name: a.digest for a in (pause, shell)}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(partial, root)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    progress(f"node images built in {time.monotonic() - t0:.1f}s ({size / 2**20:.1f} MiB): {', '.join(wanted)}")
    return [ImageLayout(a.name, wanted[a.name], a.digest) for a in (pause, shell)]
