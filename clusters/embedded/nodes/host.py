"""What the node layer needs of the platform it runs in, as a Protocol.

The platform (``clusters/embedded/platform.py``) starts the node layer and
satisfies this; the node layer never imports the platform, so the reference
platform's parts import in one direction only (a test keeps it so).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from clusters.embedded import pki as pki_mod
from clusters.embedded.controlplane import ProcRecord, Supervisor
from clusters.embedded.profile import Profile


class NodeHost(Protocol):
    """The platform as the node layer uses it: its name, run directory,
    profile and supervisor, the control plane's address, kubeconfig and PKI,
    and starting a process or a cleanup that belongs to it."""

    name: str
    run_dir: Path
    profile: Profile
    supervisor: Supervisor

    @property
    def kubeconfig(self) -> Path: ...

    @property
    def ca_file(self) -> Path: ...

    @property
    def api_server_url(self) -> str: ...

    @property
    def pki(self) -> pki_mod.ClusterPKI: ...

    def issue_node_certs(self, node_name: str, ip_addresses: Sequence[str] = ()) -> pki_mod.NodeCerts: ...

    def start_process(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      exec_argvs: Sequence[Sequence[str]] = ()) -> ProcRecord: ...

    def register_cleanup(self, function: str, **kwargs: Any) -> None: ...

    def api_client(self, *, certifier: bool = False) -> Any: ...

    def binaries(self) -> dict[str, Path]: ...
