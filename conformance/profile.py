"""The certification profile: loading, validation and the values clauses read.

``profile.yaml`` beside this file documents every field and holds the defaults
(they describe the embedded platform). A user's ``--profile FILE`` names only
what differs; unknown fields and bad values raise one
:class:`~rayproof.schema.ProfileError` naming the file, the field and what is
allowed, before anything is created on a cluster.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rayproof.schema import (
    ProfileError,
    boolean,
    duration,
    env_map,
    int_range,
    load_layered,
    one_of,
    optional,
    parse_duration,
    quantity,
)

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profile.yaml"
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
NAMESPACE_ISOLATION = ("documented", "platform")
RAY_CLUSTERS = ("perTeam", "shared")
PREEMPTION_POLICIES = ("Never", "LowerPriority", "LowerOrNewerEqualPriority")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_MOUNT = re.compile(r"^/[A-Za-z0-9._/-]*$")


def _name(v: Any) -> str:
    if not isinstance(v, str) or not _DNS_LABEL.match(v):
        raise ValueError("a Kubernetes object name (lowercase letters, digits, '-' and '.')")
    return v


def _image(v: Any) -> str:
    if not isinstance(v, str) or not _IMAGE.match(v):
        raise ValueError("a container image reference such as rayproject/ray:2.60.0")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool) or not str(v).strip():
        raise ValueError("a non-empty string")
    return str(v)


def _fraction(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError("a number greater than 0 and at most 1")
    return float(v)


def _price(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError("a non-negative number")
    return float(v)


def _mount(v: Any) -> str:
    if not isinstance(v, str) or not _MOUNT.match(v) or v == "/":
        raise ValueError("an absolute directory path other than /")
    return v.rstrip("/")


def _wait_for_pods_ready(v: Any) -> dict[str, str] | None:
    allowed = "null (off) or a mapping with timeout and backoffBase durations such as 120s"
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != {"timeout", "backoffBase"}:
        raise ValueError(allowed)
    for key in ("timeout", "backoffBase"):
        try:
            if parse_duration(v[key]) <= 0:
                raise ValueError(allowed)
        except ValueError:
            raise ValueError(allowed) from None
    return dict(v)


_PEER_KEYS, _PORT_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}, {"protocol", "port", "endPort"}


def _ingress_rules(v: Any) -> list[dict[str, Any]] | None:
    """NetworkPolicy ingress rules (``from``/``ports``); the API server checks the rest."""
    allowed = ("null (the design's policy) or a list of NetworkPolicy ingress rules, each a mapping of "
               "`from` (podSelector/namespaceSelector/ipBlock peers) and `ports` (protocol/port/endPort)")
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(r, dict) and set(r) <= {"from", "ports"} for r in v):
        raise ValueError(allowed)
    for rule in v:
        for key, keys in (("from", _PEER_KEYS), ("ports", _PORT_KEYS)):
            items = rule.get(key, [])
            if not isinstance(items, list) or not all(isinstance(i, dict) and set(i) <= keys for i in items):
                raise ValueError(allowed)
    return copy.deepcopy(v)


SCHEMA: dict[str, Any] = {
    "ray": {"image": _image, "version": _text, "headServiceType": one_of(SERVICE_TYPES), "env": env_map},
    "head": {"cpu": quantity, "memory": quantity},
    "workers": {"cpu": quantity, "memory": quantity, "gpus": int_range(0, 64)},
    "kueue": {
        "resourceFlavor": _name,
        "priorityClasses": {"low": _name, "high": _name},
        "preemption": one_of(PREEMPTION_POLICIES),
        "waitForPodsReady": _wait_for_pods_ready,  # platform-owned-ok: the platform's stated value, read, never set
        "longestHealthyPull": duration(positive=True),
    },
    "training": {
        "maxCollectiveTimeout": duration(positive=True),
        "checkpointEvery": int_range(1, 1000),
        "checkpoints": {"storageClassName": optional(_name), "size": quantity, "mountPath": _mount},
    },
    "gcsFaultTolerance": {"enabled": boolean, "redisImage": _image},
    "serving": {"availabilityTarget": _fraction, "excludeHeadFromServeService": boolean},
    "network": {"workerIngress": _ingress_rules},
    "tenancy": {"rayClusters": one_of(RAY_CLUSTERS), "namespaceIsolation": one_of(NAMESPACE_ISOLATION)},
    # platform-owned-ok: the platform's stated TTL and its teardown promise, validated here
    "operations": {"ttlSecondsAfterFinished": int_range(0, 86400), "teardownWithin": duration(positive=True)},
    "cost": {"gpuHourPrice": _price, "currency": _text},
}


def _check_relations(data: dict[str, Any], source: str) -> None:
    pcs = data["kueue"]["priorityClasses"]
    if pcs["low"] == pcs["high"]:
        raise ProfileError(f"{source}: field kueue.priorityClasses.high: must differ from low; got {pcs['high']!r}")


@dataclass(frozen=True)
class CertificationProfile:
    """A validated certification profile; ``data`` is the merged mapping."""

    data: Mapping[str, Any]
    source: str

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def seconds(self, dotted: str) -> float | None:
        """A duration field in seconds, e.g. ``seconds("training.maxCollectiveTimeout")``."""
        node: Any = self.data
        for part in dotted.split("."):
            node = None if node is None else node[part]
        return None if node is None else parse_duration(node)

    @property
    def ray_image(self) -> str:
        return str(self.data["ray"]["image"])

    @property
    def worker_gpus(self) -> int:
        return int(self.data["workers"]["gpus"])

    @property
    def wait_for_pods_ready_s(self) -> float | None:
        return self.seconds("kueue.waitForPodsReady.timeout")  # platform-owned-ok: read, never set

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.data))


# The promises a profile makes, with the range the design calls sane. A value
# outside it is printed at the top of the certificate: a platform can promise
# less, but not quietly (the clauses judge it against what it promises).
SANE_PROMISES: tuple[tuple[str, float, float, str], ...] = (
    ("serving.availabilityTarget", 0.99, 1.0, "availability during a head failure: the design asks at least 99%"),
    ("training.maxCollectiveTimeout", 1.0, 300.0,
     "fail-fast bound of a blocked collective: the design tunes it to 2-3 minutes, not the 10-30 minute defaults"),
    ("kueue.waitForPodsReady.timeout", 1.0, 300.0,  # platform-owned-ok: a promise checked against its sane range
     "eviction bound of a gang that never gets ready: the design asks 2-5 minutes"),
    ("operations.teardownWithin", 0.0, 300.0,
     "teardown of a finished job's cluster: the design asks immediate teardown"),
)


def outside_sane_ranges(profile: CertificationProfile) -> list[str]:
    """The profile's promises outside :data:`SANE_PROMISES`, one sentence each."""
    found = []
    for field, low, high, why in SANE_PROMISES:
        node: Any = profile.data
        for part in field.split("."):
            node = None if node is None else node.get(part)
        if node is None:
            found.append(f"{field} is not promised (null); {why}")
            continue
        value = node if isinstance(node, (int, float)) else parse_duration(node)
        if not low <= value <= high:
            found.append(f"{field} = {node} is outside {low:g}..{high:g}; {why}")
    return found


def load(source: str | Path | Mapping[str, Any] | None = None) -> CertificationProfile:
    """The default profile merged with ``source``; raises ProfileError on the first bad field."""
    data, name = load_layered(DEFAULT_PROFILE, SCHEMA, source, _check_relations)
    return CertificationProfile(data=data, source=name)
