"""Strict validation of layered YAML configuration (the platform and certification profiles).

A profile is a file of defaults, documented field by field, merged with a
user's file that names only what it changes. The schema is a nested mapping
whose leaves are validators; every key is listed, so an unknown key (a typo)
is an error instead of a silent fallback to a default, and the one
:class:`ProfileError` raised names the file, the dotted field and what is
allowed.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

_DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|m|s|ms))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
# Kubernetes resource.Quantity: a decimal number with an optional SI or binary suffix.
_QUANTITY_RE = re.compile(r"^(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ProfileError(ValueError):
    """A profile is invalid; the message names the field and what is allowed."""


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


def int_range(lo: int, hi: int | None = None) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}")
        return v
    return check


def optional(check: Check) -> Check:
    def opt(v: Any) -> Any:
        return None if v is None else check(v)
    return opt


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


def duration(positive: bool) -> Check:
    def check(v: Any) -> str:
        allowed = "a Go duration such as 90s, 2m or 1m30s" + (" greater than 0" if positive else "")
        try:
            seconds = parse_duration(v)
        except ValueError:
            raise ValueError(allowed) from None
        if positive and seconds <= 0:
            raise ValueError(allowed)
        return str(v)
    return check


def quantity(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not _QUANTITY_RE.match(str(v)):
        raise ValueError('a non-negative Kubernetes quantity such as 2, "500m" or "4Gi"')
    return str(v)


def one_of(options: tuple[str, ...]) -> Check:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError("one of " + ", ".join(options))
        return str(v)
    return check


def namespace_list(v: Any) -> list[str]:
    if not isinstance(v, list) or not v or any(not isinstance(x, str) or not _DNS_LABEL_RE.match(x) for x in v):
        raise ValueError("a non-empty list of namespace names (DNS-1123 labels)")
    return list(v)


def env_map(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or any(not isinstance(k, str) or not _ENV_NAME_RE.match(k) for k in v) or any(
        isinstance(x, (dict, list)) or x is None for x in v.values()
    ):
        raise ValueError("a mapping of environment variable names to scalar values")
    return {k: str(x).lower() if isinstance(x, bool) else str(x) for k, x in v.items()}


def merged(base: Any, over: Any) -> Any:
    """``over`` merged into ``base``: mappings recursively, anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = merged(base[k], v) if k in base else v
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


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror}") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None


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


def _resolve_paths(node: Any, fields: tuple[str, ...], base: Path) -> None:
    """Make the relative file paths at the dotted ``fields`` of ``node``
    absolute, against ``base`` (the directory of the file that names them)."""
    for field in fields:
        *parents, leaf = field.split(".")
        holder = node
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if isinstance(holder, dict) and isinstance(holder.get(leaf), str) and holder[leaf].strip() \
                and not Path(holder[leaf]).is_absolute():
            holder[leaf] = str((base / holder[leaf]).resolve())


def load_layered(defaults: Path, schema: Mapping[str, Any], source: str | Path | Mapping[str, Any] | None,
                 relations: Callable[[dict[str, Any], str], None] | None = None,
                 paths: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """``defaults`` merged with ``source`` (a YAML file, a mapping or None) and
    validated against ``schema``; returns the data and the name of its source.
    The dotted fields in ``paths`` are file paths: a relative one is taken
    relative to the file that names it (the working directory for a mapping)."""
    base = _read_yaml(defaults)
    if source is None:
        user: Any = {}
        name = str(defaults)
        user_dir = defaults.parent
    elif isinstance(source, Mapping):
        user, name, user_dir = copy.deepcopy(dict(source)), "profile", Path.cwd()
    else:
        path = Path(source)
        user, name, user_dir = _read_yaml(path), str(path), path.parent
    if not isinstance(user, dict):
        raise ProfileError(f"{name}: field (top level): must be a mapping; got {user!r}")
    _resolve_paths(base, paths, defaults.parent)
    _resolve_paths(user, paths, user_dir)
    # Unknown keys are reported before merging, against the user's own text.
    _check_known(user, schema, "", name)
    data = _validate(merged(base, user), schema, "", name)
    if relations is not None:
        relations(data, name)
    return data, name
