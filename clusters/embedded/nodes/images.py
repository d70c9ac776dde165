"""Container images the real nodes start from, built here as OCI image layouts.

Each image is one uncompressed layer:

* the sandbox image ``registry.k8s.io/pause:3.10.1``: the ``pause`` program
  built with the platform (``build.py``);
* the shell image ``docker.io/library/busybox:<version>``: Debian's static
  busybox with one link per applet;
* CoreDNS's image (``versions.toml`` ``[coredns] image``): the ``coredns``
  program built with the platform, alone;
* the Redis image ``docker.io/library/redis:<major.minor>`` (GCS fault
  tolerance's store): Debian's ``redis-server`` on a Debian base made by
  mmdebstrap (:func:`debian_layer`, the one step that needs Debian's mirror).

OCI image layouts are written once per content key under ``<cache>/images/``
and pushed to the nodes' registry (``registry.py``), from which every node
pulls them as any node pulls its images. (The Ray image, gigabytes, is
``rayimage.py``.)
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
COREDNS_IMAGE = build.load_versions()["coredns"]["image"]  # cluster DNS's Deployment (nodes/dns.py)
BUSYBOX = Path("/bin/busybox")
# Bump when the images' layout changes, so old cached layouts are not reused.
RECIPE = "3"
_EPOCH = 0  # every file's mtime in a layer: same inputs, same digest


@dataclass(frozen=True)
class ImageLayout:
    name: str  # the reference pods use, e.g. docker.io/library/busybox:1.35.0
    path: Path  # an OCI image layout directory (oci-layout, index.json, blobs/sha256/)
    digest: str  # the manifest's digest (what kubelet reports as imageID)


def cache_dir() -> Path:
    """Where the node images are built and their records kept (shared by every platform)."""
    return build.cache_root() / "images"


def tar_info(name: str, *, kind: bytes = tarfile.REGTYPE, size: int = 0, mode: int = 0o644,
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
            tar.addfile(tar_info(d.lstrip("/"), kind=tarfile.DIRTYPE, mode=0o1777 if d == "/tmp" else 0o755))
        for path in sorted(files):
            value = files[path]
            data, mode = value if isinstance(value, tuple) else (value, 0o644)
            tar.addfile(tar_info(path.lstrip("/"), size=len(data), mode=mode), io.BytesIO(data))
        for path, target in sorted((symlinks or {}).items()):
            tar.addfile(tar_info(path.lstrip("/"), kind=tarfile.SYMTYPE, mode=0o777, link=target))
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


SUITE = "bookworm"  # the Debian release images made from Debian's packages come from (this machine's)
MIRRORS = ("deb http://deb.debian.org/debian bookworm main",
           "deb http://deb.debian.org/debian bookworm-updates main",
           "deb http://deb.debian.org/debian-security bookworm-security main")
REDIS_PACKAGES = ("redis-server",)


def debian_layer(dest: Path, packages: Sequence[str], user: tuple[str, int, int] | None = None) -> None:
    """Debian ``minbase`` with ``packages`` (and ``user``: name, uid, gid) as an uncompressed layer tar at
    ``dest``, made by mmdebstrap from Debian's packages; ``/dev`` is left empty (the runtime mounts its own)."""
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError("the real nodes' images are made from Debian's packages by mmdebstrap, which is "
                           "missing: apt-get install -y mmdebstrap (bin/rayproof does it as root)")
    raw = dest.with_name(dest.stem + "-debian.tar")  # mmdebstrap picks its output format by the extension
    hooks = []
    if user is not None:
        name, uid, gid = user
        hooks.append(f"--customize-hook=chroot \"$1\" useradd --uid {uid} --gid {gid} --create-home "
                     f"--shell /bin/bash {name}")
    argv = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(packages)}",
            "--aptopt=Acquire::Languages \"none\"",
            *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "doc", "locale", "info")),
            *hooks, SUITE, str(raw), *MIRRORS]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "SOURCE_DATE_EPOCH": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"mmdebstrap could not make a Debian {SUITE} layer with {', '.join(packages)} "
                           f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    with tarfile.open(raw) as src, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as out:
        for member in src:
            name = member.name.removeprefix("./")
            if not name or (name.startswith("dev/") and name != "dev/"):
                continue
            member.name = name
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
    raw.unlink()


def package_version(layer: Path, package: str) -> str:
    """The version of ``package`` in the dpkg database of a Debian layer (``7.0.15-1~deb12u6``)."""
    with tarfile.open(layer) as tar:
        status = tar.extractfile("var/lib/dpkg/status").read().decode()
    for stanza in status.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " ")
        if fields.get("Package") == package:
            return fields["Version"]
    raise LookupError(f"{package} is not installed in {layer}")


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


def ensure_images(cache: Path, pause_binary: Path, coredns_binary: Path, progress=print) -> list[ImageLayout]:
    """The small node images as OCI layouts under ``cache``, built once per content: the sandbox image,
    the shell image, CoreDNS's image (the built ``coredns``, under the name versions.toml gives it) and the
    Redis image (Debian's ``redis-server``, tagged with its major.minor version)."""
    version = busybox_version()
    key_src = hashlib.sha256()
    for part in (RECIPE.encode(), pause_binary.read_bytes(), coredns_binary.read_bytes(), BUSYBOX.read_bytes(),
                 repr((SUITE, MIRRORS, REDIS_PACKAGES)).encode()):
        key_src.update(hashlib.sha256(part).digest())
    root = cache / key_src.hexdigest()[:16]
    index = root / "images.json"
    if index.is_file():
        return [ImageLayout(n, root / d["dir"], d["digest"]) for n, d in json.loads(index.read_text()).items()]
    t0 = time.monotonic()
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    pause = write_oci_layout(partial / "pause", PAUSE_IMAGE,
                             [layer_tar({"/pause": (pause_binary.read_bytes(), 0o755)})],
                             {"Entrypoint": ["/pause"], "User": "65535:65535"})
    shell = write_oci_layout(partial / "busybox", f"docker.io/library/busybox:{version}", [_busybox_layer()],
                             {"Cmd": ["sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]})
    coredns = write_oci_layout(partial / "coredns", COREDNS_IMAGE,
                               [layer_tar({"/coredns": (coredns_binary.read_bytes(), 0o755)})],
                               {"Entrypoint": ["/coredns"]})
    debian_layer(partial / "redis.tar", REDIS_PACKAGES)
    redis_version = package_version(partial / "redis.tar", "redis-server").split(":")[-1]
    major_minor = ".".join(redis_version.split(".")[:2])
    redis = write_oci_layout(partial / "redis", f"docker.io/library/redis:{major_minor}", [partial / "redis.tar"],
                             {"Cmd": ["redis-server"],
                              "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                              "Labels": {"dev.rayproof.debian-package": f"redis-server {redis_version}"}})
    made = (pause, shell, coredns, redis)
    (partial / "images.json").write_text(json.dumps(
        {a.name: {"dir": a.path.name, "digest": a.digest} for a in made}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(partial, root)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    progress(f"node images built in {time.monotonic() - t0:.1f}s ({size / 2**20:.1f} MiB): "
             f"{', '.join(a.name for a in made)}")
    return [ImageLayout(a.name, root / a.path.name, a.digest) for a in made]
