"""The certification profile: loading, validation and the values clauses read.

``profile.yaml`` beside this file documents every field and holds the defaults
(they describe the embedded platform). A user's ``--profile FILE`` names only
what differs; unknown fields and bad values raise one
:class:`~core.schema.ProfileError` naming the file, the field and what is
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

import yaml

from core.schema import (
    ProfileError,
    duration,
    int_range,
    load_layered,
    optional,
    parse_duration,
    quantity,
)

DEFAULT_PROFILE = Path(__file__).resolve().parent / "profile.yaml"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_MOUNT = re.compile(r"^/[A-Za-z0-9._/-]*$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _name(v: Any) -> str:
    if not isinstance(v, str) or not _DNS_LABEL.match(v):
        raise ValueError("a Kubernetes object name (lowercase letters, digits, '-' and '.')")
    return v


def _image(v: Any) -> str:
    if not isinstance(v, str) or not _IMAGE.match(v):
        raise ValueError("a container image reference such as rayproject/ray:2.60.0")
    return v


def _slow_pull_image(v: Any) -> str:
    """An image reference with ``{seconds}`` and ``{nonce}`` (see profile.yaml ``kueue.slowPullImage``)."""
    if (not isinstance(v, str) or "{seconds}" not in v or "{nonce}" not in v
            or not _IMAGE.match(v.replace("{seconds}", "30").replace("{nonce}", "n0"))):
        raise ValueError("an image reference with {seconds} and {nonce} in it, such as "
                         "registry.example/slow/{seconds}/busybox:{nonce}")
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


def _label_key(v: Any) -> str:
    if not isinstance(v, str) or not _LABEL_KEY.match(v):
        raise ValueError("a Kubernetes label key such as example.com/team")
    return v


def _labels(v: Any) -> dict[str, str]:
    allowed = "a mapping of Kubernetes label keys to label values (strings)"
    if not isinstance(v, dict) or not all(isinstance(k, str) and _LABEL_KEY.match(k) and isinstance(x, str)
                                          and _LABEL_VALUE.match(x) for k, x in v.items()):
        raise ValueError(allowed)
    return dict(v)


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("a path to a YAML file (relative paths are taken from the profile's directory)")
    return v


# The platform's golden templates: profile field, kind, and where the RayCluster spec sits in it.
TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "rayJob": ("RayJob", ("spec", "rayClusterSpec")),
    "rayCluster": ("RayCluster", ("spec",)),
    "rayService": ("RayService", ("spec", "rayClusterConfig")),
}
TEMPLATE_FIELDS = tuple(f"templates.{key}" for key in TEMPLATES)
_CLUSTER_AT = dict(TEMPLATES.values())


def cluster_spec_in(obj: Mapping[str, Any]) -> Any:
    """The RayCluster spec inside a RayJob, RayCluster or RayService (a template or one filled in)."""
    node: Any = obj
    for part in _CLUSTER_AT[obj["kind"]]:
        node = node[part]
    return node

SCHEMA: dict[str, Any] = {
    "templates": {key: _path for key in TEMPLATES},
    "teams": {"namespaceLabels": _labels, "tenantLabel": _label_key, "gpuQuotaLabel": _label_key,
              "localQueue": _name},
    "kueue": {
        "priorityClasses": {"low": _name, "high": _name},
        "waitForPodsReady": _wait_for_pods_ready,  # platform-owned-ok: the platform's stated value, read, never set
        "longestHealthyPull": duration(positive=True),
        "slowPullImage": optional(_slow_pull_image),
    },
    "training": {
        "maxCollectiveTimeout": duration(positive=True),
        "checkpointEvery": int_range(1, 1000),
        "checkpoints": {"storageClassName": optional(_name), "size": quantity, "mountPath": _mount},
    },
    "gcsFaultTolerance": {"redisImage": _image},
    "serving": {"availabilityTarget": _fraction},
    "operations": {"teardownWithin": duration(positive=True)},
    "cost": {"gpuHourPrice": _price, "currency": _text},
    "suitePods": {"priorityClassName": optional(_name)},
}


def _template_problem(obj: Any, kind: str, cluster_at: tuple[str, ...]) -> str | None:
    """What makes ``obj`` unusable as the golden ``kind`` template, or None."""
    if not isinstance(obj, dict):
        return f"must be one ray.io/v1 {kind} object; got {type(obj).__name__}"
    if obj.get("kind") != kind or obj.get("apiVersion") != "ray.io/v1":
        return f"must be one ray.io/v1 {kind} object; got {obj.get('apiVersion')} {obj.get('kind')}"
    spec: Any = obj
    for part in cluster_at:
        spec = spec.get(part) if isinstance(spec, dict) else None
    where = ".".join(cluster_at)
    if not isinstance(spec, dict):
        return f"has no {where} (the RayCluster spec it starts)"
    head = ((spec.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
    if not (head.get("containers") or [None])[0]:
        return f"has no {where}.headGroupSpec.template.spec.containers"
    groups = spec.get("workerGroupSpecs") or []
    if len(groups) != 1 or not (((groups[0].get("template") or {}).get("spec") or {}).get("containers") or [None])[0]:
        return (f"must have exactly one worker group in {where}.workerGroupSpecs, with containers (the suite sizes "
                f"it); got {len(groups)}")
    return None


def _load_templates(data: Mapping[str, Any], source: str) -> dict[str, dict[str, Any]]:
    templates = {}
    for key, (kind, cluster_at) in TEMPLATES.items():
        path = Path(data["templates"][key])
        try:
            obj = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ProfileError(f"{source}: field templates.{key}: cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ProfileError(f"{source}: field templates.{key}: {path} is not valid YAML: {exc}") from None
        problem = _template_problem(obj, kind, cluster_at)
        if problem:
            raise ProfileError(f"{source}: field templates.{key}: {path} {problem}")
        templates[key] = obj
    return templates


def _check_relations(data: dict[str, Any], source: str) -> None:
    pcs = data["kueue"]["priorityClasses"]
    if pcs["low"] == pcs["high"]:
        raise ProfileError(f"{source}: field kueue.priorityClasses.high: must differ from low; got {pcs['high']!r}")


# What KubeRay's default submitter pod requests (GetDefaultSubmitterContainer
# in ray-operator's controllers/ray/common/job.go, v1.1 on): a RayJob whose
# template has no submitterPodTemplate gets it.
KUBERAY_SUBMITTER_REQUESTS = {"cpu": "500m", "memory": "200Mi"}


def container_requests(container: Mapping[str, Any]) -> dict[str, str]:
    """A container's requests by resource; a limit stands for a request it
    lacks, as the API server defaults it."""
    resources = container.get("resources") or {}
    return {**{k: str(v) for k, v in (resources.get("limits") or {}).items()},
            **{k: str(v) for k, v in (resources.get("requests") or {}).items()}}


@dataclass(frozen=True)
class CertificationProfile:
    """A validated certification profile; ``data`` is the merged mapping."""

    data: Mapping[str, Any]
    source: str
    # The golden templates the profile points at, by field (rayJob, rayCluster, rayService).
    templates: Mapping[str, Mapping[str, Any]]

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def seconds(self, dotted: str) -> float | None:
        """A duration field in seconds, e.g. ``seconds("training.maxCollectiveTimeout")``."""
        node: Any = self.data
        for part in dotted.split("."):
            node = None if node is None else node[part]
        return None if node is None else parse_duration(node)

    def cluster_spec(self, template: str) -> Mapping[str, Any]:
        """The RayCluster spec inside golden template ``template`` (rayJob, rayCluster, rayService)."""
        spec: Mapping[str, Any] = cluster_spec_in(self.templates[template])
        return spec

    def _worker(self) -> Mapping[str, Any]:
        worker: Mapping[str, Any] = self.cluster_spec("rayJob")["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        return worker

    @property
    def suite_priority_class(self) -> str | None:
        """The PriorityClass of every pod the suite runs (None: the cluster's default)."""
        name: str | None = self["suitePods"]["priorityClassName"]
        return name

    @property
    def worker_tolerations(self) -> list[Mapping[str, Any]]:
        """The tolerations of a worker pod of the golden RayJob."""
        return list(self.cluster_spec("rayJob")["workerGroupSpecs"][0]["template"]["spec"].get("tolerations") or [])

    @property
    def ray_image(self) -> str:
        """The image of the golden RayJob's head: the platform's Ray image (probe pods run it too)."""
        return str(self.cluster_spec("rayJob")["headGroupSpec"]["template"]["spec"]["containers"][0]["image"])

    @property
    def worker_requests(self) -> dict[str, str]:
        """What a worker pod of the golden RayJob requests, by resource (quantities)."""
        return container_requests(self._worker())

    @property
    def gang_companion_requests(self) -> dict[str, str]:
        """What the golden RayJob's pods other than its workers request
        together, by resource: its head, and the submitter pod KubeRay starts
        for it (K8sJobMode, the default: the template's ``submitterPodTemplate``,
        else KubeRay's default submitter)."""
        from kubernetes.utils import parse_quantity

        job = self.templates["rayJob"]["spec"]
        pods = [self.cluster_spec("rayJob")["headGroupSpec"]["template"]["spec"]]
        if job.get("submissionMode", "K8sJobMode") == "K8sJobMode":
            pods.append((job.get("submitterPodTemplate") or {}).get("spec")
                        or {"containers": [{"resources": {"requests": KUBERAY_SUBMITTER_REQUESTS}}]})
        total: dict[str, Any] = {}
        for pod in pods:
            for container in pod.get("containers") or []:
                for resource, amount in container_requests(container).items():
                    total[resource] = total.get(resource, 0) + parse_quantity(amount)  # type: ignore[no-untyped-call]
        return {resource: format(amount.normalize(), "f") for resource, amount in total.items()}

    @property
    def worker_gpus(self) -> int:
        """nvidia.com/gpu of a worker pod of the golden RayJob (0: a CPU-only platform)."""
        return int(self.worker_requests.get("nvidia.com/gpu", "0"))

    @property
    def wait_for_pods_ready_s(self) -> float | None:
        return self.seconds("kueue.waitForPodsReady.timeout")  # platform-owned-ok: read, never set

    def digest(self) -> str:
        """Of the profile and the templates' contents (a changed template is a changed profile)."""
        return hashlib.sha256(json.dumps([self.data, self.templates], sort_keys=True).encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.data))

    def template_digests(self) -> dict[str, dict[str, str]]:
        """Each golden template's file and the SHA-256 (16 hex digits) of its parsed content, for the certificate."""
        return {key: {"file": str(self.data["templates"][key]),
                      "sha256": hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest()[:16]}
                for key, t in self.templates.items()}


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
    data, name = load_layered(DEFAULT_PROFILE, SCHEMA, source, _check_relations, paths=TEMPLATE_FIELDS)
    return CertificationProfile(data=data, source=name, templates=_load_templates(data, name))
