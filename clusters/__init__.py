"""Platforms the suite certifies, behind one interface.

* :class:`clusters.embedded.target.EmbeddedTarget` -- the embedded platform
  (``clusters/embedded``), brought up on this machine (the default).
* :class:`clusters.existing.ExistingCluster` -- any cluster reached by a
  kubeconfig (``--kubeconfig``).

Clauses see only :class:`Target`: a kubeconfig, an API client, a description
for the report, and ``close()``. They never ask which kind they run on; every
fault acts through the Kubernetes API.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

Progress = Callable[[str], None]


class UpgradeFailed(RuntimeError):
    """A platform's upgrade procedure did not complete; what it did before
    it stopped stays done (UPG-1 judges that too)."""


class Target(Protocol):
    """A cluster under certification."""

    #: "embedded" or "existing" (for the report only).
    kind: str

    @property
    def kubeconfig(self) -> Path: ...

    @property
    def identity(self) -> str:
        """What names this cluster from one run to the next on this machine
        (clauses of every run against it share it: fixtures/sharing.py)."""

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` with the certifying identity."""

    def describe(self) -> dict[str, Any]:
        """Server, versions (Kubernetes, KubeRay, Kueue), node count and shape, for the report."""

    def outside(self, probe: Callable[[], Any]) -> Any:
        """Run ``probe`` where a client outside the cluster stands, and
        return its result: the certifying host's own network for an existing
        cluster (the user's); for the embedded platform, a namespace beside
        its nodes that routes to their addresses and nowhere else, so no
        probe leaves the machine."""

    def diagnose(self) -> str:
        """The platform's own health, as text for a failed test's evidence:
        nodes not Ready or under pressure, and (embedded) a platform process
        that is not running, with its log's last lines."""

    def prepare_kuberay_upgrade(self, version: str, progress: Progress = ...) -> None:
        """What an upgrade to ``version`` needs before any workload runs (the
        embedded platform builds that operator; an existing cluster needs nothing)."""

    def upgrade_kuberay(self, version: str, progress: Progress = ...) -> dict[str, Any]:
        """Upgrade the KubeRay operator to ``version`` while workloads run
        (`certify --upgrade-to`): the embedded platform does it (CRDs in
        place, then the operator restarted on the new build); on an existing
        cluster the person running the suite does, and this waits until the
        operator's Deployment runs it. Returns when each step ended; raises
        UpgradeFailed when the procedure did not complete."""

    def close(self) -> None:
        """Leave the cluster as it was found (the embedded one is taken down
        only when this process brought it up)."""


def open_target(kubeconfig: str | Path | None = None, *, context: str | None = None,
                platform_name: str | None = None, platform_profile: str | Path | None = None,
                progress: Progress = lambda m: None, wait_for_room: bool = False) -> Target:
    """The cluster named by ``kubeconfig``, or the embedded platform when it is None (``wait_for_room``:
    the project's tests wait for this machine's other platforms to leave it room, see ``EmbeddedPlatform.up``)."""
    if kubeconfig is not None:
        from clusters.existing import ExistingCluster

        if platform_name or platform_profile:
            raise ValueError("--platform-name and --platform-profile apply to the embedded platform, not to --kubeconfig")
        return ExistingCluster(kubeconfig, context=context)
    from clusters.embedded.target import EmbeddedTarget

    return EmbeddedTarget.start(name=platform_name, profile=platform_profile, progress=progress,
                                wait_for_room=wait_for_room)
