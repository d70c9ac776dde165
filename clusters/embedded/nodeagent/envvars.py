"""A container's environment and command line, built as the kubelet builds them.

Order and precedence follow ``kubelet_pods.go: makeEnvironmentVariables``:
service-link variables (``<SVC>_SERVICE_HOST`` ...) first, then ``envFrom``
sources in order, then ``env`` entries in order, each ``value`` expanded with
``$(VAR)`` against what is defined so far; the image's ``ENV`` lies beneath all
of them. ``command`` and ``args`` are then expanded against the result. A
missing ConfigMap/Secret (or key) that is not ``optional`` is a
:class:`ContainerConfigError`, which the pod worker shows as the container's
``CreateContainerConfigError`` and retries, as the kubelet does.
"""
from __future__ import annotations

import base64
import re
from typing import Any, Callable, Mapping

from clusters.embedded.nodeagent.resources import container_resource, format_resource

_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")

Getter = Callable[[str, str], "Mapping[str, Any] | None"]  # (namespace, name) -> object or None


class ContainerConfigError(RuntimeError):
    """The container's configuration cannot be built yet (reason CreateContainerConfigError)."""


def expand(text: str, mapping: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, undefined
    ones are left as written, ``$$`` is a literal ``$`` (``third_party/forked/golang/expansion``)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "$" and i + 1 < n:
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end == -1:
                    out.append(text[i:])
                    break
                name = text[i + 2:end]
                out.append(mapping[name] if name in mapping else text[i:end + 1])
                i = end + 1
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def field_value(pod: Mapping[str, Any], path: str, pod_ip: str | None, host_ip: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath``."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    m = _LABEL_PATH.match(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
        "status.podIP": pod_ip or "",
        "status.podIPs": pod_ip or "",
    }
    if path in simple:
        return str(simple[path])
    if path in ("metadata.labels", "metadata.annotations"):
        return format_map(meta.get(path.split(".")[1]) or {})
    raise ContainerConfigError(f"unsupported fieldRef fieldPath {path!r}")


def format_map(values: Mapping[str, str]) -> str:
    """``key="value"`` lines, sorted: the downward API's rendering of labels/annotations."""
    import json

    return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))


def service_env(services: list[Mapping[str, Any]]) -> dict[str, str]:
    """Docker-link style variables of Services (``enableServiceLinks``), as
    ``envvars.FromServices`` renders them."""
    env: dict[str, str] = {}
    for svc in services:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or not spec.get("ports"):
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        first = spec["ports"][0]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(first["port"])
        for p in spec["ports"]:
            if p.get("name"):
                env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
        proto = (first.get("protocol") or "TCP").lower()
        env[f"{name}_PORT"] = f"{proto}://{ip}:{first['port']}"
        for p in spec["ports"]:
            pr = (p.get("protocol") or "TCP")
            prefix = f"{name}_PORT_{p['port']}_{pr.upper()}"
            env[prefix] = f"{pr.lower()}://{ip}:{p['port']}"
            env[f"{prefix}_PROTO"] = pr.lower()
            env[f"{prefix}_PORT"] = str(p["port"])
            env[f"{prefix}_ADDR"] = ip
    return env


def _source_data(kind: str, obj: Mapping[str, Any]) -> dict[str, str]:
    if kind == "secret":
        out = {k: base64.b64decode(v).decode("utf-8", errors="replace") for k, v in (obj.get("data") or {}).items()}
        out.update(obj.get("stringData") or {})
        return out
    out = dict(obj.get("data") or {})
    for k, v in (obj.get("binaryData") or {}).items():
        out.setdefault(k, base64.b64decode(v).decode("utf-8", errors="replace"))
    return out


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    pod_ip: str | None,
    host_ip: str,
    allocatable: Mapping[str, str],
    get_configmap: Getter,
    get_secret: Getter,
    services_env: Mapping[str, str],
) -> dict[str, str]:
    """The container's own variables (without the image's ENV), in kubelet order."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = dict(services_env)

    def fetch(kind: str, name: str, optional: bool) -> dict[str, str] | None:
        getter = get_configmap if kind == "configmap" else get_secret
        obj = getter(ns, name)
        if obj is None:
            if optional:
                return None
            raise ContainerConfigError(f'{kind} "{name}" not found')
        return _source_data(kind, obj)

    for src in container.get("envFrom") or []:
        prefix = src.get("prefix") or ""
        if src.get("configMapRef"):
            ref, kind = src["configMapRef"], "configmap"
        elif src.get("secretRef"):
            ref, kind = src["secretRef"], "secret"
        else:
            continue
        data = fetch(kind, ref.get("name", ""), bool(ref.get("optional")))
        for k, v in (data or {}).items():
            key = prefix + k
            if _ENV_NAME.match(key):  # invalid names are skipped (with an event, upstream)
                env[key] = v

    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var or var.get("valueFrom") is None:
            env[name] = expand(var.get("value") or "", env)
            continue
        vf = var["valueFrom"]
        if vf.get("fieldRef"):
            env[name] = field_value(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif vf.get("resourceFieldRef"):
            ref = vf["resourceFieldRef"]
            target = container
            if ref.get("containerName"):
                target = next((c for c in _all_containers(pod) if c["name"] == ref["containerName"]), container)
            value = container_resource(target, ref["resource"], allocatable)
            env[name] = format_resource(value, ref["resource"], ref.get("divisor"))
        elif vf.get("configMapKeyRef") or vf.get("secretKeyRef"):
            kind = "configmap" if vf.get("configMapKeyRef") else "secret"
            ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
            data = fetch(kind, ref.get("name", ""), bool(ref.get("optional")))
            if data is None:
                continue
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f"couldn't find key {ref['key']} in {kind.capitalize()} {ns}/{ref.get('name')}")
            env[name] = data[ref["key"]]
        else:
            raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(vf)}")
    return env


def _all_containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def command_line(container: Mapping[str, Any], env: Mapping[str, str], entrypoint: list[str],
                 cmd: list[str]) -> list[str]:
    """The argv to exec, as the runtime merges pod and image: ``command``
    replaces the image's ENTRYPOINT, ``args`` replace its CMD; both are
    expanded against the container's environment."""
    command = [expand(c, env) for c in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    if command:
        return command + args
    return list(entrypoint) + (args if container.get("args") else list(cmd))
