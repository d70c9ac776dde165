"""The Ray image the real nodes run: Debian's Python with the suite's pinned Ray and torch.

``docker.io/rayproject/ray:<Ray version>`` (the name the golden templates use)
is built here from packages, in two layers:

1. **base**: Debian bookworm ``minbase`` with ``python3.11``, ``wget`` and
   ``procps`` (KubeRay's probes call ``wget``; Ray's tooling ``ps``) and the
   user ``ray`` (uid 1000, gid 100 ``users``, as in Ray's own images), made by
   ``mmdebstrap`` from Debian's packages: a real dpkg database, nothing of
   this machine's files.
2. **env**: the Python distributions ``ray[default,train,serve]`` and
   ``torch`` need (their dependency closure, markers evaluated), copied file by
   file as their ``RECORD`` lists them from the suite's own environment, where
   pip installed them from the locked wheels, to where ``pip install`` as root
   puts them on Debian: ``/usr/local/lib/python3.11/dist-packages`` and
   ``/usr/local/bin`` (scripts' ``#!`` rewritten to ``/usr/bin/python3.11``).
   The same pinned versions as the suite, CUDA libraries included: about 6 GB,
   as users' Ray images with torch are.

The registry storage (``registry.py``, cached across platforms) is the cache:
``<cache>/images/ray-<key>.json`` records the manifest pushed for a content
key (recipe, Debian suite, the distributions and their versions); an ``up``
whose registry holds that manifest and its blobs builds nothing. A build
writes its layers under ``<cache>/images/ray-<key>.partial/`` and removes
them once pushed. The uncompressed layers go to the nodes as they are: the
registry is on this machine, and unpacking gzip on every node would cost
more than it saves.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import sysconfig
import tarfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator

from clusters.embedded.nodes import registry
from clusters.embedded.nodes.images import MIRRORS, SUITE, debian_layer, tar_info, write_oci_layout

RECIPE = "1"  # bump when the image's layout changes
DEBIAN_PACKAGES = ("python3.11", "wget", "procps")
ROOTS = ("ray[default,train,serve]", "torch")  # what the image is for; everything they need comes along
PYTHON = "/usr/bin/python3.11"
SITE = "usr/local/lib/python3.11/dist-packages"  # Debian's site directory for local installs
RAY_USER = ("ray", 1000, 100)


@dataclass(frozen=True)
class Distribution:
    name: str
    version: str
    dist: metadata.Distribution


def closure(roots: tuple[str, ...] = ROOTS, path: list[str] | None = None) -> list[Distribution]:
    """The installed distributions ``roots`` need (requirements with extras and markers), sorted by name."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=path or sys.path)}
    wanted: dict[str, Distribution] = {}
    seen: set[tuple[str, str]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        dist = installed.get(name)
        if dist is None:
            raise RuntimeError(f"the Ray image needs the Python distribution {req.name}, which is not installed "
                               f"in {sys.prefix}: bin/rayproof installs requirements.lock there")
        wanted[name] = Distribution(name, dist.version, dist)
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for text in dist.requires or ():
                sub = Requirement(text)
                if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                    todo.append(sub)
    return [wanted[n] for n in sorted(wanted)]


def image_name() -> str:
    return f"docker.io/rayproject/ray:{metadata.version('ray')}"


def content_key(dists: list[Distribution]) -> str:
    h = hashlib.sha256()
    for part in (RECIPE, SUITE, *MIRRORS, *DEBIAN_PACKAGES, repr(RAY_USER), sys.version.split()[0],
                 *(f"{d.name}=={d.version}" for d in dists)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _image_path(src: Path, prefix: Path, site: Path) -> str | None:
    """Where a file of the suite's environment goes in the image (None: outside the environment)."""
    try:
        return f"{SITE}/{src.relative_to(site)}"
    except ValueError:
        pass
    try:
        return f"usr/local/{src.relative_to(prefix)}"
    except ValueError:
        return None


def _env_files(dists: list[Distribution]) -> Iterator[tuple[str, Path]]:
    prefix, site = Path(sys.prefix).resolve(), Path(sysconfig.get_paths()["purelib"]).resolve()
    for d in dists:
        for rel in d.dist.files or ():
            src = Path(os.path.normpath(d.dist.locate_file(rel)))
            if not src.is_file():
                continue  # RECORD lists .pyc files Python never wrote
            dest = _image_path(src, prefix, site)
            if dest is not None:
                yield dest, src


def _env_layer(dest: Path, dists: list[Distribution], progress: Callable[[str], None]) -> int:
    """The distributions as an uncompressed layer tar at ``dest``; returns the files' total size."""
    prefix = str(Path(sys.prefix).resolve())
    total, dirs = 0, set()
    files = sorted(dict(_env_files(dists)).items())
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        def add_dir(path: str) -> None:
            parent = os.path.dirname(path)
            if parent and parent not in dirs:
                add_dir(parent)
            if path not in dirs:
                dirs.add(path)
                tar.addfile(tar_info(path, kind=tarfile.DIRTYPE, mode=0o755))

        for i, (path, src) in enumerate(files):
            add_dir(os.path.dirname(path))
            mode = 0o755 if os.access(src, os.X_OK) else 0o644
            if path.startswith("usr/local/bin/"):
                data = src.read_bytes()
                first, nl, rest = data.partition(b"\n")
                if first.startswith(b"#!") and prefix.encode() in first:
                    data = b"#!" + PYTHON.encode() + nl + rest  # the script's interpreter, as pip writes it
                tar.addfile(tar_info(path, size=len(data), mode=mode), io.BytesIO(data))
                total += len(data)
            else:
                size = src.stat().st_size
                with src.open("rb") as f:
                    tar.addfile(tar_info(path, size=size, mode=mode), f)
                total += size
            if i % 5000 == 0:
                progress(f"Ray image: environment layer {i}/{len(files)} files, {total / 2**30:.1f} GiB")
        for name in ("python", "python3"):  # `python` as in Ray's images (KubeRay and the workloads call it)
            tar.addfile(tar_info(f"usr/local/bin/{name}", kind=tarfile.SYMTYPE, mode=0o777, link=PYTHON))
    return total


def last_build(cache: Path) -> dict | None:
    """What building the current Ray image took (its record: seconds, bytes), or None if never built."""
    record = cache / f"ray-{content_key(closure())}.json"
    return json.loads(record.read_text()) if record.is_file() else None


def ensure(cache: Path, base_url: str, progress: Callable[[str], None] = print) -> str:
    """Make sure the registry at ``base_url`` holds the Ray image; build and push it if not. Returns its name."""
    name = image_name()
    dists = closure()
    key = content_key(dists)
    record = cache / f"ray-{key}.json"
    if record.is_file() and registry.has_manifest(base_url, name, json.loads(record.read_text())["digest"]):
        return name
    work = cache / f"ray-{key}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        t0 = time.monotonic()
        progress(f"Ray image {name}: building (Debian {SUITE} base by mmdebstrap, {len(dists)} Python "
                 "distributions); once per version")
        debian_layer(work / "base.tar", DEBIAN_PACKAGES, user=RAY_USER)
        t_base = time.monotonic() - t0
        size = _env_layer(work / "env.tar", dists, progress)
        user, uid, gid = RAY_USER
        layout = write_oci_layout(work / "layout", name, [work / "base.tar", work / "env.tar"], {
            "Cmd": ["/bin/bash"], "User": f"{uid}:{gid}", "WorkingDir": f"/home/{user}",
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", f"HOME=/home/{user}",
                    "LANG=C.UTF-8", "RAY_USAGE_STATS_ENABLED=0"],
            "Labels": {"dev.rayproof.ray": metadata.version("ray"), "dev.rayproof.torch": metadata.version("torch")}})
        t_build = time.monotonic() - t0
        t1 = time.monotonic()
        sent = registry.push(layout.path, name, base_url)
        t_push = time.monotonic() - t1
        record.write_text(json.dumps({"name": name, "digest": layout.digest, "environment_bytes": size,
                                      "built_s": round(t_build, 1), "base_s": round(t_base, 1),
                                      "pushed_bytes": sent, "push_s": round(t_push, 1)}, indent=1))
        progress(f"Ray image {name}: built in {t_build:.0f}s (Debian base {t_base:.0f}s), environment "
                 f"{size / 2**30:.2f} GiB; pushed {sent / 2**30:.2f} GiB to the node registry in {t_push:.0f}s")
        return name
    finally:
        shutil.rmtree(work, ignore_errors=True)
