"""Loading and validating the embedded platform's profile.

``profile.yaml`` beside this file holds every field with its documented
default; a user profile names only what it changes and is merged over it.
Validation is strict and reports the first problem as one
:class:`ProfileError` naming the file, the dotted field and what is allowed,
because a profile that silently falls back to a default would certify a
platform other than the one the user described.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from core.schema import (  # noqa: F401 - parse_duration and ProfileError are re-exported
    ProfileError,
    boolean,
    duration,
    env_map,
    int_range,
    load_layered,
    namespace_list,
    one_of,
    optional,
    parse_duration,
    quantity,
)

# What the nodes are called: <prefix>-1..N.
NODE_NAME_PREFIX = "rayproof-node"

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profile.yaml"

MAX_NODES = 16
# Frameworks Kueue v0.17.0 registers that this platform can actually run
# (the CRDs of the others are not installed).
KUEUE_INTEGRATIONS = ("batch/job", "ray.io/rayjob", "ray.io/raycluster", "ray.io/rayservice", "pod")
REQUEUING_TIMESTAMPS = ("Eviction", "Creation")
# How an operator upgrade updates the KubeRay CRDs (profile.yaml says what each does).
UPGRADE_CRD_PROCEDURES = ("apply", "recreate")

# What runs a node: upstream kubelet with containerd and runc (nodes/). The project's node
# agent (`agent`) retired in issue 39; the field stays so that profiles naming kubelet load.
NODE_RUNTIMES = ("kubelet",)
RETIRED_NODE_RUNTIMES = {"agent": "the project's node agent retired (issue 39): nodes run kubelet"}

_GATE_RE = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@dataclass(frozen=True)
class Profile:
    """A validated profile. ``data`` is the full merged mapping."""

    data: Mapping[str, Any]
    source: str

    @property
    def node_count(self) -> int:
        return int(self.data["nodes"]["count"])

    @property
    def node_runtime(self) -> str:
        """``kubelet`` (upstream kubelet, containerd and runc): the only node runtime."""
        return str(self.data["nodes"]["runtime"])

    @property
    def prepull_images(self) -> list[str]:
        """Images every kubelet node pulls at ``up`` (``nodes/prepull.py``)."""
        return list(self.data["nodes"]["prepullImages"])

    @property
    def node_shape(self) -> dict[str, str]:
        """Capacity each node advertises, as Kubernetes quantity strings."""
        return {k: str(v) for k, v in self.data["nodes"]["shape"].items() if str(v) != "0"}

    @property
    def enforces_network_policy(self) -> bool:
        """NetworkPolicy has an engine (kube-router in each node)."""
        return bool(self.data["network"]["enforceNetworkPolicy"])

    @property
    def policy_engine_nodes(self) -> list[str] | None:
        """The nodes the NetworkPolicy engine runs on, where not all (``network.policyEngineNodes``: the first N)."""
        n = self.data["network"]["policyEngineNodes"]
        if n is None or n >= self.node_count:
            return None
        return [f"{NODE_NAME_PREFIX}-{i}" for i in range(1, n + 1)]

    @property
    def cuts_open_connections(self) -> bool:
        """A new NetworkPolicy also stalls connections opened before it (``true``); kube-router, the
        nodes' engine, keeps them (``null``, its own way, or ``false``)."""
        return self.enforces_network_policy and self.data["network"]["policyCutsOpenConnections"] is True

    @property
    def control_plane(self) -> Mapping[str, Any]:
        return self.data["controlPlane"]

    @property
    def kueue(self) -> Mapping[str, Any]:
        return self.data["kueue"]

    @property
    def kuberay(self) -> Mapping[str, Any]:
        return self.data["kuberay"]

    def digest(self) -> str:
        """A stable hash of the profile, recorded in the platform's state so a
        running platform is reused only for the same profile."""
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.data))


def _integrations(v: Any) -> list[str]:
    allowed = "a list of distinct names from " + ", ".join(KUEUE_INTEGRATIONS)
    if not isinstance(v, list) or not v or len(set(v)) != len(v) or any(x not in KUEUE_INTEGRATIONS for x in v):
        raise ValueError(allowed)
    return list(v)


def _node_runtime(v: Any) -> str:
    if isinstance(v, str) and v in RETIRED_NODE_RUNTIMES:
        raise ValueError(f"{' or '.join(NODE_RUNTIMES)} ({RETIRED_NODE_RUNTIMES[v]})")
    return one_of(NODE_RUNTIMES)(v)


def _images(v: Any) -> list[str]:
    if not isinstance(v, list) or len(set(v)) != len(v) or not all(
            isinstance(x, str) and re.match(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$", x) for x in v):
        raise ValueError("a list of distinct container image references, such as [rayproject/ray:2.60.0]")
    return list(v)


def _gates(v: Any) -> dict[str, bool]:
    if not isinstance(v, dict) or any(not isinstance(k, str) or not _GATE_RE.match(k) for k in v) or any(
        not isinstance(x, bool) for x in v.values()
    ):
        raise ValueError("a mapping of feature-gate names (CamelCase) to true/false")
    return dict(v)


# The schema: nested dicts end in validators. Every key is listed, so unknown
# keys are detected and the error can list what is allowed.
SCHEMA: dict[str, Any] = {
    "nodes": {
        "count": int_range(1, MAX_NODES),
        "runtime": _node_runtime,
        "shape": {
            "cpu": quantity,
            "memory": quantity,
            "nvidia.com/gpu": int_range(0, 64),
        },
        "prepullImages": _images,
    },
    "controlPlane": {
        "nodeMonitorGracePeriod": duration(positive=True),
        "notReadyTolerationSeconds": int_range(0),
        "unreachableTolerationSeconds": int_range(0),
    },
    "kueue": {
        "waitForPodsReady": {
            "enable": boolean,
            "timeout": duration(positive=True),
            "blockAdmission": boolean,
            "recoveryTimeout": optional(duration(positive=False)),
            "requeuingStrategy": {
                "timestamp": one_of(REQUEUING_TIMESTAMPS),
                "backoffLimitCount": optional(int_range(0)),
                "backoffBaseSeconds": int_range(1),
                "backoffMaxSeconds": int_range(1),
            },
        },
        "integrations": _integrations,
    },
    "network": {"enforceNetworkPolicy": boolean, "policyCutsOpenConnections": optional(boolean),
                "policyEngineNodes": optional(int_range(1, MAX_NODES))},
    "kuberay": {
        "env": env_map,
        "featureGates": _gates,
        "upgradeCRDs": one_of(UPGRADE_CRD_PROCEDURES),
        "upgradeWatchNamespaces": optional(namespace_list),
    },
}


def _check_relations(data: dict[str, Any], source: str) -> None:
    rs = data["kueue"]["waitForPodsReady"]["requeuingStrategy"]
    if rs["backoffMaxSeconds"] < rs["backoffBaseSeconds"]:
        raise ProfileError(
            f"{source}: field kueue.waitForPodsReady.requeuingStrategy.backoffMaxSeconds: must be "
            f">= backoffBaseSeconds ({rs['backoffBaseSeconds']}); got {rs['backoffMaxSeconds']}"
        )


def load_profile(source: str | Path | Mapping[str, Any] | None = None) -> Profile:
    """The default profile, merged with ``source`` (a YAML file or a mapping).

    Raises :class:`ProfileError` naming the first bad field and what is allowed.
    """
    data, name = load_layered(DEFAULT_PROFILE, SCHEMA, source, _check_relations)
    return Profile(data=data, source=name)
