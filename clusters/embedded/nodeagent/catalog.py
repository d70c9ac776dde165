"""The image catalog: which container images this node "has", and what running one means.

There is no image filesystem here: a container runs on the host's files in its
own namespaces (see ``shim.py``). An *image* therefore only decides the
container's environment -- above all its ``PATH`` -- as the image's config
(``ENV``, ``WORKDIR``) would. The catalog below is the whole registry this node
can pull from; an image that matches no entry fails to pull exactly as an
unknown image does on a real node (``ErrImagePull``, then ``ImagePullBackOff``
with back-off, the container never starts and the pod never becomes Ready).

| entry | matches (last path component of the repository, tag ignored) | runs with |
| --- | --- | --- |
| ``ray`` | ``rayproject/*`` or any repository whose name contains ``ray`` | the project's Python environment first on ``PATH`` (Ray, torch), ``PYTHONPATH`` = the repository (``workloads`` importable), ``RAY_USAGE_STATS_ENABLED=0``; ``bash``/``wget`` from the host |
| ``redis`` | ``redis*`` | the host's ``redis-server`` on ``PATH`` |
| ``shell`` | ``busybox*``, ``bash*``, ``debian*``, ``ubuntu*``, ``alpine*`` | the host's shell tools |
| ``python`` | ``python*`` | the host's ``python3`` (as ``python`` too) first on ``PATH`` |

Slow pulls (ADM-3's straggler): ``rayproof.local/slow-pull/<seconds>/<image>``
resolves like ``<image>`` but its first pull on each node takes ``<seconds>``
(the container waits in ``ContainerCreating`` meanwhile, as during a real
slow pull); later pulls on that node are instant, as with a cached image.
The real nodes pull the same names through the registry's slow path
(``nodes/slowpull.py``), really.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from clusters.embedded.nodes.slowpull import REFERENCE as SLOW_PULL

REPO_ROOT = Path(__file__).resolve().parents[3]
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageNotFound(LookupError):
    """The image is not in the catalog: a pull of it fails."""


@dataclass(frozen=True)
class Image:
    """What a resolved image contributes to a container."""

    reference: str  # as written in the pod spec
    entry: str  # catalog entry name
    env: dict[str, str] = field(default_factory=dict)  # the image's ENV
    workdir: str = "/"  # the image's WORKDIR
    pull_seconds: float = 0.0  # simulated duration of the first pull on a node
    forced_env: dict[str, str] = field(default_factory=dict)  # set whatever the pod says
    entrypoint: tuple[str, ...] = ()  # the image's ENTRYPOINT
    cmd: tuple[str, ...] = ()  # the image's CMD

    @property
    def image_id(self) -> str:
        """A stable content-addressed-looking id, for containerStatuses[].imageID."""
        digest = hashlib.sha256(f"{self.entry}:{self.reference}".encode()).hexdigest()
        return f"{normalise(self.reference)}@sha256:{digest}"


def normalise(reference: str) -> str:
    """``docker.io/library/<name>:<tag>`` form, as containerd reports image names."""
    ref = reference.split("@", 1)[0]
    name, tag = ref, "latest"
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = ref.rsplit(":", 1)
    parts = name.split("/")
    if len(parts) == 1:
        parts = ["docker.io", "library", *parts]
    elif "." not in parts[0] and ":" not in parts[0] and parts[0] != "localhost":
        parts = ["docker.io", *parts]
    return "/".join(parts) + ":" + tag


def _repo_parts(reference: str) -> tuple[str, str]:
    """(namespace path, last component) of the repository, without tag/digest."""
    name = normalise(reference).rsplit(":", 1)[0]
    parts = name.split("/")
    return "/".join(parts[1:-1]), parts[-1]


def _python_env() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {
        "PATH": f"{venv_bin}:{HOST_PATH}",
        "PYTHONPATH": str(REPO_ROOT),
        "VIRTUAL_ENV": str(Path(sys.executable).parent.parent),
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


_REDIS_ENTRYPOINT = 'case "${1:-}" in -*|*.conf) set -- redis-server "$@";; esac; exec "$@"'


def tools_dir_for(state_dir: Path) -> Path:
    """A directory holding ``python`` and ``python3`` (links to the host's
    python3), for ``python*`` images whose commands say ``python``."""
    d = state_dir / "image-tools"
    d.mkdir(parents=True, exist_ok=True)
    host = shutil.which("python3", path=HOST_PATH) or "/usr/bin/python3"
    for name in ("python", "python3"):
        link = d / name
        if not link.is_symlink():
            link.symlink_to(host)
    return d


def lookup(reference: str, tools_dir: str = "/usr/bin") -> Image:
    """The catalog entry for ``reference``; raises :class:`ImageNotFound`.

    ``tools_dir`` is :func:`tools_dir_for` of the agent's state dir."""
    pull = 0.0
    m = SLOW_PULL.match(reference)
    inner = reference
    if m:
        pull = float(m.group("seconds"))
        inner = m.group("image")
    namespace, repo = _repo_parts(inner)
    if namespace.endswith("rayproject") or "ray" in repo:
        env = _python_env()
        # Ray's usage reporting would try to reach the internet; the suite's
        # safety rule is that no Ray process ever does, whatever the pod says.
        return Image(reference, "ray", env, "/", pull, forced_env={"RAY_USAGE_STATS_ENABLED": "0"},
                     cmd=("bash",))
    if repo.startswith("redis"):
        if shutil.which("redis-server", path=HOST_PATH) is None:
            raise ImageNotFound("redis-server is not installed on this host (apt-get install -y redis-server)")
        # The official image's docker-entrypoint.sh runs redis-server for
        # args that start with "-"; modelled by an ENTRYPOINT that is a shell.
        return Image(reference, "redis", {"PATH": HOST_PATH, "HOME": "/root"}, "/", pull,
                     entrypoint=("/bin/sh", "-c", _REDIS_ENTRYPOINT, "docker-entrypoint.sh"), cmd=("redis-server",))
    if repo.startswith(("busybox", "bash", "debian", "ubuntu", "alpine")):
        return Image(reference, "shell", {"PATH": HOST_PATH, "HOME": "/root"}, "/", pull,
                     cmd=("sh",) if repo.startswith(("busybox", "alpine")) else ("bash",))
    if repo.startswith("python"):
        return Image(reference, "python",
                     {"PATH": f"{tools_dir}:{HOST_PATH}", "HOME": "/root", "LANG": "C.UTF-8"}, "/", pull,
                     cmd=("python3",))
    raise ImageNotFound(
        f'failed to pull and unpack image "{normalise(inner)}": failed to resolve reference '
        f'"{normalise(inner)}": {normalise(inner)}: not found (not in the rayproof node image catalog, '
        f"clusters/embedded/nodeagent/catalog.py)")
