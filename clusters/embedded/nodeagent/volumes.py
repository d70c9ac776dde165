"""Pod volumes: materialised on the host under the pod's directory, bind-mounted into containers.

What the kubelet's volume plugins do, for the volume types Ray pods use:

* ``emptyDir`` -- a directory per pod (``medium: Memory``: a tmpfs on the host,
  sized by ``sizeLimit``, unmounted when the pod goes);
* ``configMap``, ``secret``, ``downwardAPI``, ``projected`` (with
  ``serviceAccountToken`` from the TokenRequest API) -- written with the
  kubelet's atomic-writer layout (``..data`` -> ``..<timestamp>``, one symlink
  per key), always mounted read-only, and refreshed on resync so an updated
  ConfigMap appears in running pods, as upstream;
* ``hostPath`` -- the host path itself (``DirectoryOrCreate``/``FileOrCreate``
  create it, the other types check it);
* ``persistentVolumeClaim`` -- the PV's ``hostPath``/``local`` path when the
  claim is bound to such a PV (for a PV of the ``rayproof-node-local`` class,
  the node's own subdirectory of it, as a node's disk), otherwise one
  directory per claim under
  ``<state>/pvc/<namespace>/<claim>`` shared by every pod and node (all nodes
  are this machine), so checkpoints survive pods, as on networked storage.

A volume that cannot be set up (missing ConfigMap, unbound claim, unsupported
type) raises :class:`VolumeError`; the pod stays ``ContainerCreating`` with a
``FailedMount`` event and is retried, as upstream.
"""
from __future__ import annotations

import base64
import datetime as _dt
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from clusters.embedded.nodeagent.envvars import expand, field_value
from clusters.embedded.nodeagent.kube import ApiError, KubeClient
from clusters.embedded.nodeagent.provisioner import NODE_LOCAL_CLASS
from clusters.embedded.nodeagent.resources import container_resource, format_resource, parse_quantity

# Volumes whose content the kubelet writes itself; they are read-only in containers.
ATOMIC_TYPES = ("configMap", "secret", "downwardAPI", "projected")
DEFAULT_TOKEN_SECONDS = 3607
# The kubelet refreshes a projected token once 80% of its lifetime has passed.
TOKEN_REFRESH_FRACTION = 0.8


class VolumeError(RuntimeError):
    """A volume cannot be set up (yet); shown as a FailedMount event."""


@dataclass
class Mount:
    """One bind mount into a container: host ``source`` at container ``target``."""

    source: str
    target: str
    readonly: bool = False
    type: str = "bind"
    options: str = ""

    def as_spec(self) -> dict[str, Any]:
        return {"type": self.type, "source": self.source, "target": self.target, "readonly": self.readonly,
                "options": self.options}


def write_atomic(directory: Path, files: Mapping[str, tuple[bytes, int]]) -> bool:
    """Make ``directory`` hold exactly ``files`` (relative path -> (content, mode)),
    the kubelet's AtomicWriter way; return whether anything changed.

    Readers see either the old or the new set: payload goes into a fresh
    ``..<timestamp>`` directory, then the ``..data`` symlink is swapped
    atomically, and each top-level name is a symlink through ``..data``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    data_link = directory / "..data"
    if data_link.is_symlink():
        current = directory / os.readlink(data_link)
        if _same_payload(current, files):
            return False
    else:
        current = None
    stamp = "..%s.%d" % (_dt.datetime.now(_dt.timezone.utc).strftime("%Y_%m_%d_%H_%M_%S"), time.monotonic_ns())
    payload = directory / stamp
    payload.mkdir()
    for rel, (content, mode) in files.items():
        path = payload / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, mode)
    tmp_link = directory / "..data_tmp"
    if tmp_link.is_symlink():
        tmp_link.unlink()
    tmp_link.symlink_to(stamp)
    os.replace(tmp_link, data_link)
    tops = {rel.split("/", 1)[0] for rel in files}
    for top in tops:
        link = directory / top
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link) if link.is_dir() else link.unlink()
            link.symlink_to(f"..data/{top}")
    for entry in directory.iterdir():
        if entry.name.startswith(".."):
            continue
        if entry.name not in tops:
            entry.unlink() if entry.is_symlink() or entry.is_file() else shutil.rmtree(entry)
    if current is not None and current.exists():
        shutil.rmtree(current, ignore_errors=True)
    return True


def _same_payload(current: Path, files: Mapping[str, tuple[bytes, int]]) -> bool:
    try:
        have = {str(p.relative_to(current)) for p in current.rglob("*") if p.is_file()}
        if have != set(files):
            return False
        return all((current / rel).read_bytes() == content for rel, (content, _) in files.items())
    except OSError:
        return False


def _mode(default: int | None, item_mode: int | None) -> int:
    return item_mode if item_mode is not None else (default if default is not None else 0o644)


def _items(data: Mapping[str, bytes], items: list[Mapping[str, Any]] | None, default_mode: int | None,
           what: str, optional: bool) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {k: (v, _mode(default_mode, None)) for k, v in data.items()}
    out = {}
    for it in items:
        if it["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"configmap/secret {what}: key {it['key']!r} not found")
        out[it["path"]] = (data[it["key"]], _mode(default_mode, it.get("mode")))
    return out


class PodVolumes:
    """The volumes of one pod on one node."""

    def __init__(self, pod: Mapping[str, Any], pod_dir: Path, state_dir: Path, api: KubeClient, *,
                 host_ip: str, allocatable: Mapping[str, str], pod_ip: Callable[[], str | None]):
        self.pod = pod
        self.dir = pod_dir / "volumes"
        self.state_dir = state_dir
        self.api = api
        self.host_ip = host_ip
        self.allocatable = allocatable
        self.pod_ip = pod_ip
        self.paths: dict[str, Path] = {}  # volume name -> host path
        self.host_mounts: list[str] = []  # tmpfs we mounted on the host
        self._token_refresh_at: dict[str, float] = {}

    @property
    def ns(self) -> str:
        return self.pod["metadata"]["namespace"]

    # -- set up -----------------------------------------------------------------

    def setup(self) -> None:
        """Materialise every volume; raises :class:`VolumeError` naming the first that fails."""
        for vol in (self.pod.get("spec") or {}).get("volumes") or []:
            name = vol["name"]
            try:
                self.paths[name] = self._setup_one(vol)
            except ApiError as exc:
                raise VolumeError(f'MountVolume.SetUp failed for volume "{name}" : {exc}') from exc
            except VolumeError as exc:
                raise VolumeError(f'MountVolume.SetUp failed for volume "{name}" : {exc}') from exc

    def refresh(self) -> None:
        """Re-read the sources of atomically written volumes (resync)."""
        for vol in (self.pod.get("spec") or {}).get("volumes") or []:
            kind = next((k for k in ATOMIC_TYPES if vol.get(k) is not None), None)
            if kind is not None and vol["name"] in self.paths:
                try:
                    self._setup_one(vol)
                except (ApiError, VolumeError):
                    pass  # keep the last good content, as the kubelet does

    def _setup_one(self, vol: Mapping[str, Any]) -> Path:
        name = vol["name"]
        if vol.get("emptyDir") is not None:
            return self._empty_dir(name, vol["emptyDir"] or {})
        if vol.get("hostPath") is not None:
            return self._host_path(vol["hostPath"])
        if vol.get("persistentVolumeClaim") is not None:
            return self._pvc(vol["persistentVolumeClaim"])
        if vol.get("configMap") is not None:
            d = self.dir / "configmap" / name
            write_atomic(d, self._configmap_files(vol["configMap"]))
            return d
        if vol.get("secret") is not None:
            d = self.dir / "secret" / name
            write_atomic(d, self._secret_files(vol["secret"]))
            return d
        if vol.get("downwardAPI") is not None:
            d = self.dir / "downward-api" / name
            spec = vol["downwardAPI"]
            write_atomic(d, self._downward_files(spec.get("items") or [], spec.get("defaultMode")))
            return d
        if vol.get("projected") is not None:
            d = self.dir / "projected" / name
            write_atomic(d, self._projected_files(name, vol["projected"]))
            return d
        kinds = sorted(k for k in vol if k != "name")
        raise VolumeError(f"volume type {kinds} is not supported by the rayproof node agent")

    def _empty_dir(self, name: str, spec: Mapping[str, Any]) -> Path:
        d = self.dir / "empty-dir" / name
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o777)
        if spec.get("medium") == "Memory" and not os.path.ismount(d):
            size = spec.get("sizeLimit")
            opts = "mode=1777" + (f",size={int(parse_quantity(size))}" if size else "")
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, f"rayproof-{name}", str(d)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise VolumeError(f"mount tmpfs for emptyDir {name}: {proc.stderr.strip()}")
            self.host_mounts.append(str(d))
        return d

    def _host_path(self, spec: Mapping[str, Any]) -> Path:
        p = Path(spec["path"])
        kind = spec.get("type") or ""
        if kind == "DirectoryOrCreate" and not p.exists():
            p.mkdir(parents=True, mode=0o755)
        elif kind == "FileOrCreate" and not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch(mode=0o644)
        elif kind == "Directory" and not p.is_dir():
            raise VolumeError(f"hostPath type check failed: {p} is not a directory")
        elif kind == "File" and not p.is_file():
            raise VolumeError(f"hostPath type check failed: {p} is not a file")
        elif kind in ("Socket", "CharDevice", "BlockDevice") and not p.exists():
            raise VolumeError(f"hostPath type check failed: {p} does not exist")
        return p

    def _pvc(self, spec: Mapping[str, Any]) -> Path:
        claim = spec["claimName"]
        try:
            pvc = self.api.get(f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{claim}")
        except ApiError as exc:
            if exc.not_found:
                raise VolumeError(f'persistentvolumeclaim "{claim}" not found') from None
            raise
        pv_name = (pvc.get("spec") or {}).get("volumeName")
        if pv_name:
            try:
                pv = self.api.get(f"/api/v1/persistentvolumes/{pv_name}")
                pv_spec = pv.get("spec") or {}
                for key in ("hostPath", "local"):
                    if pv_spec.get(key) and pv_spec[key].get("path"):
                        p = Path(pv_spec[key]["path"])
                        node_local = pv_spec.get("storageClassName") == NODE_LOCAL_CLASS
                        if node_local:
                            p = p / self.pod["spec"]["nodeName"]
                        p.mkdir(parents=True, exist_ok=True)
                        if node_local:
                            p.chmod(0o777)  # as the provisioner leaves the claim's directory
                        return p
            except ApiError:
                pass
        d = self.state_dir / "pvc" / self.ns / claim
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o777)
        return d

    def _get(self, kind: str, name: str, optional: bool) -> dict[str, Any] | None:
        try:
            return self.api.get(f"/api/v1/namespaces/{self.ns}/{kind}/{name}")
        except ApiError as exc:
            if exc.not_found:
                if optional:
                    return None
                raise VolumeError(f'{kind[:-1]} "{name}" not found') from None
            raise

    def _configmap_files(self, spec: Mapping[str, Any], default_mode: int | None = None) -> dict[str, tuple[bytes, int]]:
        optional = bool(spec.get("optional"))
        cm = self._get("configmaps", spec.get("name", ""), optional)
        if cm is None:
            return {}
        data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
        mode = spec.get("defaultMode", default_mode)
        return _items(data, spec.get("items"), mode, spec.get("name", ""), optional)

    def _secret_files(self, spec: Mapping[str, Any], default_mode: int | None = None) -> dict[str, tuple[bytes, int]]:
        optional = bool(spec.get("optional"))
        name = spec.get("secretName") or spec.get("name", "")
        sec = self._get("secrets", name, optional)
        if sec is None:
            return {}
        data = {k: base64.b64decode(v) for k, v in (sec.get("data") or {}).items()}
        mode = spec.get("defaultMode", default_mode)
        return _items(data, spec.get("items"), mode, name, optional)

    def _downward_files(self, items: list[Mapping[str, Any]], default_mode: int | None) -> dict[str, tuple[bytes, int]]:
        out = {}
        containers = list((self.pod.get("spec") or {}).get("containers") or []) + list(
            (self.pod.get("spec") or {}).get("initContainers") or [])
        for it in items:
            if it.get("fieldRef"):
                path = it["fieldRef"]["fieldPath"]
                value = field_value(self.pod, path, self.pod_ip(), self.host_ip)
            elif it.get("resourceFieldRef"):
                ref = it["resourceFieldRef"]
                c = next((c for c in containers if c["name"] == ref.get("containerName")), None)
                if c is None:
                    raise VolumeError(f"downwardAPI: no container {ref.get('containerName')!r}")
                value = format_resource(container_resource(c, ref["resource"], self.allocatable), ref["resource"],
                                        ref.get("divisor"))
            else:
                continue
            out[it["path"]] = (value.encode(), _mode(default_mode, it.get("mode")))
        return out

    def _projected_files(self, vol_name: str, spec: Mapping[str, Any]) -> dict[str, tuple[bytes, int]]:
        mode = spec.get("defaultMode")
        out: dict[str, tuple[bytes, int]] = {}
        for src in spec.get("sources") or []:
            if src.get("configMap"):
                out.update(self._configmap_files(src["configMap"], mode))
            elif src.get("secret"):
                out.update(self._secret_files(src["secret"], mode))
            elif src.get("downwardAPI"):
                out.update(self._downward_files(src["downwardAPI"].get("items") or [], mode))
            elif src.get("serviceAccountToken"):
                tok = src["serviceAccountToken"]
                out[tok["path"]] = (self._token(vol_name, tok).encode(), _mode(mode, 0o600 if mode is None else None))
            elif src.get("clusterTrustBundle"):
                raise VolumeError("clusterTrustBundle projections are not supported by the rayproof node agent")
        return out

    def _token(self, vol_name: str, spec: Mapping[str, Any]) -> str:
        """A service-account token bound to this pod (TokenRequest), reused until 80% of its life."""
        key = f"{vol_name}/{spec['path']}"
        cache = self.dir / "projected" / vol_name / "..data" / spec["path"]
        if key in self._token_refresh_at and time.time() < self._token_refresh_at[key] and cache.exists():
            return cache.read_text()
        meta = self.pod["metadata"]
        sa = (self.pod.get("spec") or {}).get("serviceAccountName") or "default"
        seconds = int(spec.get("expirationSeconds") or DEFAULT_TOKEN_SECONDS)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [spec["audience"]] if spec.get("audience") else None,
                         "expirationSeconds": seconds,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                            "uid": meta["uid"]}}}
        resp = self.api.post(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        self._token_refresh_at[key] = time.time() + seconds * TOKEN_REFRESH_FRACTION
        return resp["status"]["token"]

    # -- mounts -----------------------------------------------------------------

    def mounts_for(self, container: Mapping[str, Any], env: Mapping[str, str]) -> list[Mount]:
        """The container's ``volumeMounts`` as bind mounts (``subPath``/``subPathExpr`` resolved)."""
        volumes = {v["name"]: v for v in (self.pod.get("spec") or {}).get("volumes") or []}
        out = []
        for vm in container.get("volumeMounts") or []:
            name = vm["name"]
            if name not in self.paths:
                raise VolumeError(f"volumeMount {name!r}: no such volume in the pod")
            source = self.paths[name]
            sub = vm.get("subPath") or (expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else "")
            if sub:
                if sub.startswith("/") or ".." in Path(sub).parts:
                    raise VolumeError(f"subPath {sub!r} must be a relative path without '..'")
                source = source / sub
                if not source.exists() and not source.is_symlink():
                    source.mkdir(parents=True, exist_ok=True)  # the kubelet creates missing subPath dirs
                source = Path(os.path.realpath(source))
            vol = volumes.get(name, {})
            atomic = any(vol.get(k) is not None for k in ATOMIC_TYPES)
            out.append(Mount(str(source), vm["mountPath"], readonly=bool(vm.get("readOnly")) or atomic))
        return out

    def teardown(self) -> None:
        for m in self.host_mounts:
            subprocess.run(["umount", "-l", m], capture_output=True)
        self.host_mounts.clear()
