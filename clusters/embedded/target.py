"""The embedded platform as a certification target (see :mod:`clusters`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from clusters import Progress
from clusters.embedded import build
from clusters.embedded.platform import EmbeddedPlatform
from clusters.existing import describe_cluster

DEFAULT_TARGET_NAME = "default"


class EmbeddedTarget:
    """The embedded platform; brought up if needed, taken down by ``close``
    only when this process brought it up."""

    kind = "embedded"

    def __init__(self, platform: EmbeddedPlatform, *, started_here: bool):
        self.platform = platform
        self.started_here = started_here

    @classmethod
    def start(cls, *, name: str | None = None, profile: Any = None, run_dir: Path | None = None,
              progress: Progress = lambda m: None) -> "EmbeddedTarget":
        p = EmbeddedPlatform(name or DEFAULT_TARGET_NAME, run_dir=run_dir, profile=profile, progress=progress)
        was_up = p.status().get("healthy") is True and p.state.read().get("profile_digest") == p.profile.digest()
        p.up()
        return cls(p, started_here=not was_up)

    @property
    def kubeconfig(self) -> Path:
        return self.platform.kubeconfig

    def api_client(self) -> Any:
        return self.platform.api_client()

    def describe(self) -> dict[str, Any]:
        info = describe_cluster(self.api_client())
        info["kind"] = "embedded platform (node agent in place of kubelet + container runtime)"
        pins = build.pinned_versions()
        info["versions"].update({"kuberay": pins.get("kuberay"), "kueue": pins.get("kueue"),
                                 "etcd": pins.get("etcd")})
        info["platform_profile"] = self.platform.profile.as_dict()
        return info

    def close(self) -> None:
        if self.started_here:
            self.platform.down()
