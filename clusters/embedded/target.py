"""The embedded platform as a certification target (see :mod:`clusters`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from clusters import Progress
from clusters.embedded import build
from clusters.embedded.platform import EmbeddedPlatform
from clusters.existing import describe_cluster, node_health

DEFAULT_TARGET_NAME = "default"
# What the certificate says the cluster is, by the profile's nodes.runtime (kubelet, the only one
# since the node agent retired: certificates of the node agent said "embedded platform (node agent
# in place of kubelet + container runtime)").
KINDS = {
    "kubelet": "embedded platform (real nodes: kubelet, containerd and runc; CoreDNS; NetworkPolicy by "
               "kube-router in each node)",
}
# How much of an unhealthy platform process's log a failed test's evidence shows.
LOG_TAIL_LINES = 40


class EmbeddedTarget:
    """The embedded platform; brought up if needed, and taken down by the
    last test session to ``close`` it when a test session brought it up."""

    kind = "embedded"
    # Its control plane and its nodes' pods share this machine's CPUs.
    runs_on_this_machine = True

    def __init__(self, platform: EmbeddedPlatform):
        self.platform = platform

    @classmethod
    def start(cls, *, name: str | None = None, profile: Any = None, run_dir: Path | None = None,
              progress: Progress = lambda m: None, wait_for_room: bool = False) -> "EmbeddedTarget":
        """Bring the platform up unless it runs with this profile already.

        Test sessions share it: each one that brings it up or finds it
        brought up by another session records its process in the run
        directory (``users/``), and the last to close takes it down, so
        pytest-xdist workers and the ``certify`` command that started them
        use one platform. One whose recorded sessions are all gone
        (SIGKILLed) is adopted. A platform brought up by ``rayproof up``
        records nobody and is never taken down here. ``wait_for_room``: see
        :meth:`EmbeddedPlatform.up`.
        """
        p = EmbeddedPlatform(name or DEFAULT_TARGET_NAME, run_dir=run_dir, profile=profile, progress=progress)
        p.up(session=True, wait_for_room=wait_for_room)
        return cls(p)

    @staticmethod
    def wait_for_room(*, name: str | None = None, profile: Any = None, run_dir: Path | None = None) -> None:
        """Wait, holding nothing, for this machine to have room for the platform :meth:`start` would
        start (see :meth:`EmbeddedPlatform.wait_for_room`)."""
        EmbeddedPlatform(name or DEFAULT_TARGET_NAME, run_dir=run_dir, profile=profile).wait_for_room()

    @property
    def kubeconfig(self) -> Path:
        """The certifying identity's: the suite's ClusterRole, not the platform's admin."""
        return self.platform.certifier_kubeconfig

    @property
    def identity(self) -> str:
        # Not its API server's address: that is a new port each time it comes up.
        return f"embedded platform {self.platform.name} ({self.platform.run_dir})"

    def api_client(self) -> Any:
        return self.platform.api_client(certifier=True)

    def describe(self) -> dict[str, Any]:
        info = describe_cluster(self.api_client())
        info["kind"] = KINDS[self.platform.profile.node_runtime]
        pins = {**build.pinned_versions(), **(self.platform.state.read().get("versions") or {})}  # an upgraded KubeRay
        info["versions"].update({"kuberay": pins.get("kuberay"), "kueue": pins.get("kueue"),
                                 "etcd": pins.get("etcd")})
        info["platform_profile"] = self.platform.profile.as_dict()
        return info

    def outside(self, probe: Any) -> Any:
        """From the platform's outside namespace (nodes/fabric.py, ``OutsideNet``), routed to the nodes'
        addresses, never from this machine's own namespace."""
        from clusters.embedded.nodes.fabric import OutsideNet
        from clusters.embedded.podnet._host import in_netns

        return in_netns(OutsideNet(self.platform.name).netns, probe)

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

    def prepare_kuberay_upgrade(self, version: str, progress: Progress = lambda m: None) -> None:
        """Build the KubeRay operator ``version`` from its Go module (once; cached)."""
        build.ensure_kuberay_built(version, progress)

    def upgrade_kuberay(self, version: str, progress: Progress = lambda m: None) -> dict[str, Any]:
        """Upgrade the platform's KubeRay operator to ``version`` in place (CRDs, then the operator)."""
        return self.platform.upgrade_kuberay(version, progress)

    def close(self) -> None:
        self.platform.leave()


def is_orphaned(platform: EmbeddedPlatform) -> bool:
    """Brought up by test sessions of which none runs any more."""
    return platform.session_owned() and not platform.session_users()
