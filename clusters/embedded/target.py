"""The embedded platform as a certification target (see :mod:`clusters`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from clusters import Progress
from clusters.embedded import build
from clusters.embedded.platform import EmbeddedPlatform
from clusters.existing import describe_cluster, node_health
from fixtures import janitor

DEFAULT_TARGET_NAME = "default"
# How much of an unhealthy platform process's log a failed test's evidence shows.
LOG_TAIL_LINES = 40


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
        """Bring the platform up unless it runs with this profile already.

        A platform a test session started records that session's process in
        its run directory (``owner``). One found running whose recorded
        session is gone (SIGKILLed) is adopted: this session takes it down at
        the end. A platform brought up by ``rayproof up`` records nobody and
        is never taken down here.
        """
        p = EmbeddedPlatform(name or DEFAULT_TARGET_NAME, run_dir=run_dir, profile=profile, progress=progress)
        was_up = p.status().get("healthy") is True and p.state.read().get("profile_digest") == p.profile.digest()
        orphaned = was_up and is_orphaned(p)
        if orphaned:
            progress(f"adopting platform {p.name}, left running by a test session that is gone")
        p.up()
        started_here = not was_up or orphaned
        if started_here:
            janitor.write_owner(p.run_dir)
        return cls(p, started_here=started_here)

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

    def diagnose(self) -> str:
        """Node health, and every platform process that is not healthy with its log's last lines."""
        parts = [node_health(self.api_client())]
        health = self.platform.health()
        sick = {name: why for name, why in health.items() if why != "ok"}
        parts.append(f"platform {self.platform.name}: " + (f"unhealthy {sick}" if sick else
                                                           f"all {len(health)} processes healthy"))
        for rec in self.platform.supervisor.records():
            if rec.name in sick:
                lines = Path(rec.log).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if Path(rec.log).exists() else []
                parts.append(f"--- {rec.name} (PID {rec.pid}), last {len(lines)} lines of {rec.log}\n" + "\n".join(lines))
        return "\n".join(parts)

    def close(self) -> None:
        if self.started_here:
            self.platform.down()


def is_orphaned(platform: EmbeddedPlatform) -> bool:
    """Started by a test session (it recorded its owner) that no longer runs."""
    return (platform.run_dir / "owner").exists() and not janitor.owner_alive(platform.run_dir)
