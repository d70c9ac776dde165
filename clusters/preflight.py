"""Checks before a certification run creates anything.

:func:`preflight` reads only (discovery, ``/version``, self-subject access
reviews, the operators' Deployments, nodes, ``get`` of the objects the
profile names) and raises one :class:`PreflightError` whose message says
what is wrong and what to do: an unreachable API server, a missing CRD or
API version, missing RBAC, an operator that is installed but not running or
older than the clauses need, a cluster where not one gang of the golden
RayJob's shape fits, or a profile naming objects the cluster does not have.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from clusters import access

# (group, version, plural): the APIs the clauses write.
REQUIRED_APIS = (
    ("ray.io", "v1", "rayclusters", "KubeRay (v1.3 or newer; verified with v1.5.0)"),
    ("ray.io", "v1", "rayjobs", "KubeRay (v1.3 or newer; verified with v1.5.0)"),
    ("ray.io", "v1", "rayservices", "KubeRay (v1.3 or newer; verified with v1.5.0)"),
    ("kueue.x-k8s.io", "v1beta2", "clusterqueues", "Kueue serving kueue.x-k8s.io/v1beta2 (verified with v0.17.0)"),
    ("kueue.x-k8s.io", "v1beta2", "localqueues", "Kueue serving kueue.x-k8s.io/v1beta2 (verified with v0.17.0)"),
    ("kueue.x-k8s.io", "v1beta2", "workloads", "Kueue serving kueue.x-k8s.io/v1beta2 (verified with v0.17.0)"),
    ("kueue.x-k8s.io", "v1beta2", "resourceflavors", "Kueue serving kueue.x-k8s.io/v1beta2 (verified with v0.17.0)"),
    ("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses",
     "Kueue serving kueue.x-k8s.io/v1beta2 (verified with v0.17.0)"),
)

DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
# The oldest operator releases whose behaviour the clauses assert on, read
# from the operators' image tags where their Deployments are found.
MIN_OPERATOR_VERSIONS = {
    "kuberay": ((1, 3, 0), "spec.gcsFaultToleranceOptions (GCS-1, GCS-2)"),
    "kueue": ((0, 15, 0), "the v1beta2 configuration, waitForPodsReady always on (ADM-3, ADM-4)"),
}
# Workers of a gang: a gang of the golden RayJob's shape, as most clauses submit it.
GANG_WORKERS = 2


class PreflightError(RuntimeError):
    """The cluster or the profile cannot be certified as they are; nothing was created."""


def preflight(api: Any, profile: Any, *, server_timeout_s: float = 10.0) -> dict[str, Any]:
    """Check reachability, APIs, RBAC and the profile's references; return what was found."""
    from kubernetes import client

    host = api.configuration.host
    try:
        version = client.VersionApi(api).get_code(_request_timeout=server_timeout_s).git_version
    except client.ApiException as exc:
        if exc.status in (401, 403):
            raise PreflightError(
                f"the API server at {host} refused the kubeconfig's credentials (HTTP {exc.status}); "
                "refresh them (e.g. re-run your cloud's get-credentials) and try again") from None
        raise PreflightError(f"the API server at {host} answered HTTP {exc.status} to GET /version: {exc.reason}") from None
    except Exception as exc:  # noqa: BLE001 - urllib3/SSL/socket errors: all mean "cannot reach it"
        raise PreflightError(
            f"cannot reach the API server at {host}: {_root_cause(exc)}. Check the kubeconfig's server and "
            "context (--kubeconfig/--context), your network path to it, or run `bin/rayproof up` and omit "
            "--kubeconfig to certify the embedded platform") from None

    missing_apis = _missing_apis(api)
    if missing_apis:
        lines = [f"{g}/{v} {plural} (install {what})" for g, v, plural, what in missing_apis]
        raise PreflightError(
            f"the cluster at {host} does not serve the APIs this suite needs: " + "; ".join(lines)
            + ". Install KubeRay and Kueue (with their CRDs) and run again; nothing was created")

    denied = denied_access(api, access.checks())
    if denied:
        user = _whoami(api)
        raise PreflightError(
            f"{user} may not do what the certification does: cannot " + ", ".join(denied)
            + f". Apply the ClusterRoles of {access.SHIPPED_ROLE_FILE} and bind {access.ROLE_NAME} to this "
            "identity with a ClusterRoleBinding (the suite creates its own namespaces, so a namespaced Role is not "
            f"enough; each run binds {access.RUN_ROLE_NAME} itself); nothing was created")

    gaps = access.run_role_gaps(api)
    if gaps:
        raise PreflightError(
            f"the ClusterRole {access.RUN_ROLE_NAME}, which each run binds in the namespaces it creates, does not "
            f"grant what the certification does there: " + ", ".join(gaps)
            + f". Apply {access.SHIPPED_ROLE_FILE} (both of its ClusterRoles); nothing was created")

    let_through = access.write_let_through(api)
    if let_through:
        raise PreflightError(
            f"the API server at {host} lets {_whoami(api)} write outside the namespaces its runs create ({let_through}): "
            f"apply {access.SHIPPED_GUARD_FILE} (a ValidatingAdmissionPolicy, Kubernetes 1.30+) with this identity's "
            "username in it, so the cluster itself confines the certification; nothing was created")

    problems = operator_problems(api)
    if problems:
        raise PreflightError(f"the operators on the cluster at {host} cannot run the clauses: " + "; ".join(problems)
                             + "; nothing was created")

    fit = workers_that_fit(api, profile)
    if fit < GANG_WORKERS:
        raise PreflightError(
            f"not one gang of the golden RayJob's shape fits the cluster at {host}: {GANG_WORKERS} workers of "
            f"{_worker_shape(profile)} each, and its Ready, schedulable nodes that the workers tolerate hold {fit} "
            "(nodes' allocatable). Add capacity, or name a smaller golden RayJob template; nothing was created")

    problems = profile_problems(api, profile)
    if problems:
        raise PreflightError(f"the profile ({profile.source}) does not match the cluster at {host}: "
                             + "; ".join(problems) + ". Fix the profile or the cluster; nothing was created")
    return {"server": host, "kubernetes": version}


def _root_cause(exc: BaseException) -> str:
    seen = exc
    while seen.__cause__ is not None or getattr(seen, "reason", None) is not None:
        nxt = seen.__cause__ or getattr(seen, "reason", None)
        if not isinstance(nxt, BaseException) or nxt is seen:
            break
        seen = nxt
    return f"{type(seen).__name__}: {seen}"


def _missing_apis(api: Any) -> list[tuple[str, str, str, str]]:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    served: dict[tuple[str, str], set[str] | None] = {}
    missing = []
    for group, version, plural, what in REQUIRED_APIS:
        key = (group, version)
        if key not in served:
            try:
                served[key] = {r.name for r in custom.get_api_resources(group, version).resources}
            except client.ApiException as exc:
                if exc.status != 404:  # 404: the group/version is not served
                    raise
                served[key] = None
        if not served[key] or plural not in served[key]:
            missing.append((group, version, plural, what))
    return missing


def denied_access(api: Any, checks: Sequence[tuple[str, str, str, str, str]]) -> list[str]:
    """The checks a SelfSubjectAccessReview denies, as "verb group/resource[/sub][ name]" strings."""
    from kubernetes import client

    authz = client.AuthorizationV1Api(api)
    denied = []
    for verb, group, resource, sub, name in checks:
        review = authz.create_self_subject_access_review({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "group": group, "resource": resource,
                                            "subresource": sub or None, "name": name or None}}})
        if not review.status.allowed:
            what = f"{group}/{resource}" if group else resource
            denied.append(f"{verb} {what}{'/' + sub if sub else ''}{' ' + name if name else ''}")
    return denied


def _whoami(api: Any) -> str:
    try:
        return f"user {access.username(api)!r}"
    except Exception:  # noqa: BLE001 - only for the message
        return "the kubeconfig's identity"


def profile_problems(api: Any, profile: Any) -> list[str]:
    """What the profile names that the cluster lacks (priority classes, the
    suite pods' PriorityClass or one that may preempt, the checkpoint
    StorageClass or, when it names none, a default one)."""
    from kubernetes import client

    objs = client.CustomObjectsApi(api)
    problems = []
    values = {}
    for level, name in profile["kueue"]["priorityClasses"].items():
        try:
            wpc = objs.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses", name)
            values[level] = int(wpc.get("value", 0))
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            problems.append(f"kueue.priorityClasses.{level}: WorkloadPriorityClass {name!r} does not exist")
    if len(values) == 2 and values["high"] <= values["low"]:
        problems.append(f"kueue.priorityClasses: high ({values['high']}) must have a greater value than "
                        f"low ({values['low']})")
    suite_class = profile.suite_priority_class
    if suite_class:
        try:
            found = client.SchedulingV1Api(api).read_priority_class(suite_class)
            if found.preemption_policy != "Never":
                problems.append(f"suitePods.priorityClassName: PriorityClass {suite_class!r} has preemptionPolicy "
                                f"{found.preemption_policy}: the suite's pods could preempt other tenants' pods; "
                                "name one with preemptionPolicy Never")
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            problems.append(f"suitePods.priorityClassName: PriorityClass {suite_class!r} does not exist; have the "
                            f"cluster's admins apply {access.SHIPPED_PRIORITY_CLASS_FILE}")
    classes = client.StorageV1Api(api).list_storage_class().items
    wanted = profile["training"]["checkpoints"]["storageClassName"]
    if wanted and wanted not in {c.metadata.name for c in classes}:
        problems.append(f"training.checkpoints.storageClassName: StorageClass {wanted!r} does not exist")
    if not wanted and not any((c.metadata.annotations or {}).get(DEFAULT_CLASS_ANNOTATION) == "true" for c in classes):
        problems.append("training.checkpoints.storageClassName: not set (the cluster's default StorageClass), but the "
                        "cluster has no default StorageClass; name the ReadWriteMany class for checkpoints")
    return problems


def operator_problems(api: Any) -> list[str]:
    """KubeRay or Kueue Deployments with no available replica (installed but
    down), or older than :data:`MIN_OPERATOR_VERSIONS`. An operator whose
    Deployment is not found (one run outside the cluster, the embedded
    platform's processes) is not judged here."""
    from clusters.existing import image_tag, operator_deployments

    problems = []
    for name, deployments in operator_deployments(api).items():
        if not deployments:
            continue
        if not any((d.status.available_replicas or 0) >= 1 for d in deployments):
            problems.append(f"{name}: Deployment " + ", ".join(
                f"{d.metadata.namespace}/{d.metadata.name} ({d.status.available_replicas or 0} of "
                f"{d.spec.replicas} replicas available)" for d in deployments)
                + " is installed but not running; see `kubectl -n NAMESPACE describe deployment NAME`")
        minimum, needed_for = MIN_OPERATOR_VERSIONS[name]
        for d in deployments:
            version = _version(image_tag(d) or "")
            if version and version < minimum:
                problems.append(f"{name}: {d.metadata.namespace}/{d.metadata.name} runs {image_tag(d)}, older than "
                                f"v{'.'.join(map(str, minimum))} which {needed_for} need; upgrade it")
    return problems


def _version(tag: str) -> tuple[int, int, int] | None:
    match = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", tag)
    return tuple(int(x) for x in match.groups()) if match else None  # type: ignore[return-value]


def workers_that_fit(api: Any, profile: Any, beside: Mapping[str, str] | None = None) -> int:
    """How many workers of the golden RayJob's shape the cluster's Ready,
    schedulable nodes hold at once, by every resource a worker requests (its
    GPUs, CPUs and memory), counting only nodes whose NoSchedule and NoExecute
    taints the worker pod tolerates; with ``beside`` (requests by resource),
    only the workers each node holds beside those."""
    from kubernetes import client
    from kubernetes.utils import parse_quantity

    # A worker is one pod, and what it requests.
    requests = {r: parse_quantity(q) for r, q in profile.worker_requests.items()}
    per_worker = {"pods": 1, **{r: amount for r, amount in requests.items() if amount > 0}}
    reserved = {r: parse_quantity(q) for r, q in (beside or {}).items()}
    tolerations = profile.worker_tolerations
    workers = 0
    for node in client.CoreV1Api(api).list_node().items:
        ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
        repelled = [t for t in node.spec.taints or [] if t.effect in ("NoSchedule", "NoExecute")
                    and not any(_tolerates(tol, t) for tol in tolerations)]
        if ready and not node.spec.unschedulable and not repelled:
            allocatable = {"pods": "110", **(node.status.allocatable or {})}  # kubelet's maxPods if unsaid
            workers += max(0, min(int((parse_quantity(allocatable.get(r, "0")) - reserved.get(r, 0)) // amount)
                                  for r, amount in per_worker.items()))
    return workers


def _tolerates(toleration: Any, taint: Any) -> bool:
    """Kubernetes' toleration rule: same key (or an empty key with Exists),
    same effect (or none), and Exists or an equal value."""
    if toleration.get("effect") and toleration["effect"] != taint.effect:
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.key
    return toleration.get("key") == taint.key and (toleration.get("value") or "") == (taint.value or "")


def _worker_shape(profile: Any) -> str:
    return ", ".join(f"{amount} {resource}" for resource, amount in sorted(profile.worker_requests.items()))
