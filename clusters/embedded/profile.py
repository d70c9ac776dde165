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
from typing import Any, Callable, Mapping

import yaml

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profile.yaml"

MAX_NODES = 16
# Frameworks Kueue v0.17.0 registers that this platform can actually run
# (the CRDs of the others are not installed).
KUEUE_INTEGRATIONS = ("batch/job", "ray.io/rayjob", "ray.io/raycluster", "ray.io/rayservice", "pod")
REQUEUING_TIMESTAMPS = ("Eviction", "Creation")

_DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|m|s|ms))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
# Kubernetes resource.Quantity: a decimal number with an optional SI or binary suffix.
_QUANTITY_RE = re.compile(r"^(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GATE_RE = re.compile(r"^[A-Z][A-Za-z0-9]*$")


class ProfileError(ValueError):
    """A profile is invalid; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Profile:
    """A validated profile. ``data`` is the full merged mapping."""

    data: Mapping[str, Any]
    source: str

    @property
    def node_count(self) -> int:
        return int(self.data["nodes"]["count"])

    @property
    def node_shape(self) -> dict[str, str]:
        """Capacity each node advertises, as Kubernetes quantity strings."""
        return {k: str(v) for k, v in self.data["nodes"]["shape"].items() if str(v) != "0"}

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


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string such as ``"90s"``, ``"1m30s"``."""
    if not isinstance(text, str) or not _DURATION_RE.match(text):
        raise ValueError(text)
    return sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))


# --------------------------------------------------------------------------
# Field validators: each returns the normalised value or raises ValueError
# with the "allowed" part of the message.
# --------------------------------------------------------------------------

Check = Callable[[Any], Any]


def _int_range(lo: int, hi: int | None = None) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}")
        return v
    return check


def _optional(check: Check) -> Check:
    def opt(v: Any) -> Any:
        return None if v is None else check(v)
    return opt


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


def _duration(positive: bool) -> Check:
    def check(v: Any) -> str:
        allowed = "a Go duration such as 90s, 2m or 1m30s" + (" greater than 0" if positive else "")
        try:
            seconds = parse_duration(v)
        except ValueError:
            raise ValueError(allowed) from None
        if positive and seconds <= 0:
            raise ValueError(allowed)
        return v
    return check


def _quantity(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not _QUANTITY_RE.match(str(v)):
        raise ValueError('a non-negative Kubernetes quantity such as 2, "500m" or "4Gi"')
    return str(v)


def _one_of(options: tuple[str, ...]) -> Check:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError("one of " + ", ".join(options))
        return v
    return check


def _integrations(v: Any) -> list[str]:
    allowed = "a list of distinct names from " + ", ".join(KUEUE_INTEGRATIONS)
    if not isinstance(v, list) or not v or len(set(v)) != len(v) or any(x not in KUEUE_INTEGRATIONS for x in v):
        raise ValueError(allowed)
    return list(v)


def _env(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or any(not isinstance(k, str) or not _ENV_NAME_RE.match(k) for k in v) or any(
        isinstance(x, (dict, list)) or x is None for x in v.values()
    ):
        raise ValueError("a mapping of environment variable names to scalar values")
    return {k: str(x).lower() if isinstance(x, bool) else str(x) for k, x in v.items()}


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
        "count": _int_range(1, MAX_NODES),
        "shape": {
            "cpu": _quantity,
            "memory": _quantity,
            "nvidia.com/gpu": _int_range(0, 64),
        },
    },
    "controlPlane": {
        "nodeMonitorGracePeriod": _duration(positive=True),
        "notReadyTolerationSeconds": _int_range(0),
        "unreachableTolerationSeconds": _int_range(0),
    },
    "kueue": {
        "waitForPodsReady": {
            "timeout": _duration(positive=True),
            "blockAdmission": _bool,
            "recoveryTimeout": _optional(_duration(positive=False)),
            "requeuingStrategy": {
                "timestamp": _one_of(REQUEUING_TIMESTAMPS),
                "backoffLimitCount": _optional(_int_range(0)),
                "backoffBaseSeconds": _int_range(1),
                "backoffMaxSeconds": _int_range(1),
            },
        },
        "integrations": _integrations,
    },
    "kuberay": {
        "env": _env,
        "featureGates": _gates,
    },
}


def _merge(base: Any, over: Any) -> Any:
    """``over`` merged into ``base``: mappings recursively, anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return copy.deepcopy(over)


def _validate(node: Any, schema: Any, path: str, source: str) -> Any:
    if callable(schema):
        try:
            return schema(node)
        except ValueError as exc:
            raise ProfileError(f"{source}: field {path}: must be {exc}; got {node!r}") from None
    if not isinstance(node, dict):
        raise ProfileError(
            f"{source}: field {path or '(top level)'}: must be a mapping with keys "
            f"{', '.join(schema)}; got {node!r}"
        )
    unknown = [k for k in node if k not in schema]
    if unknown:
        where = f"{path}." if path else ""
        raise ProfileError(
            f"{source}: field {where}{unknown[0]}: unknown; allowed here: {', '.join(schema)}"
        )
    out = {}
    for key, sub in schema.items():
        child = f"{path}.{key}" if path else key
        # Absent only when the user wrote an explicit null over a mapping.
        out[key] = _validate(node.get(key), sub, child, source)
    return out


def _check_relations(data: dict[str, Any], source: str) -> None:
    rs = data["kueue"]["waitForPodsReady"]["requeuingStrategy"]
    if rs["backoffMaxSeconds"] < rs["backoffBaseSeconds"]:
        raise ProfileError(
            f"{source}: field kueue.waitForPodsReady.requeuingStrategy.backoffMaxSeconds: must be "
            f">= backoffBaseSeconds ({rs['backoffBaseSeconds']}); got {rs['backoffMaxSeconds']}"
        )


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror}") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None


def load_profile(source: str | Path | Mapping[str, Any] | None = None) -> Profile:
    """The default profile, merged with ``source`` (a YAML file or a mapping).

    Raises :class:`ProfileError` naming the first bad field and what is allowed.
    """
    defaults = _read_yaml(DEFAULT_PROFILE)
    if source is None:
        user: Any = {}
        name = str(DEFAULT_PROFILE)
    elif isinstance(source, Mapping):
        user, name = copy.deepcopy(dict(source)), "profile"
    else:
        path = Path(source)
        user, name = _read_yaml(path), str(path)
    if not isinstance(user, dict):
        raise ProfileError(f"{name}: field (top level): must be a mapping; got {user!r}")
    # Unknown keys are reported before merging, against the user's own text.
    _check_known(user, SCHEMA, "", name)
    data = _validate(_merge(defaults, user), SCHEMA, "", name)
    _check_relations(data, name)
    return Profile(data=data, source=name)


def _check_known(node: Any, schema: Any, path: str, source: str) -> None:
    if callable(schema) or not isinstance(node, dict):
        return
    for key, value in node.items():
        if key not in schema:
            where = f"{path}." if path else ""
            raise ProfileError(
                f"{source}: field {where}{key}: unknown; allowed here: {', '.join(schema)}"
            )
        _check_known(value, schema[key], f"{path}.{key}" if path else key, source)
