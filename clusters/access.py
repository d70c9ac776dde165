"""What the suite may do on a cluster: one table, read by preflight and rendered as the shipped ClusterRole.

:data:`RULES` lists every API access the certification makes, each with the
reason. Preflight asks the API server (self-subject access reviews) for each
verb of each rule before it creates anything; ``clusters/rbac/`` ships the
same table as a ClusterRole (``python -m clusters.access`` writes it; a test
keeps the file and the table equal). The embedded platform certifies with an
identity bound to that ClusterRole and nothing else, so every certification
of it shows the role is enough.

Two roles. :data:`RULES`, bound cluster-wide, reads, creates namespaces
with the run's label and binds :data:`RUN_RULES` (every write, and the
reads of a run's own namespaces) in each namespace the run has just created
(:func:`bind_run_role`), so ``kubectl auth can-i`` answers no for every
write anywhere else. The roles read no Secrets (a run creates one: a GCS
Redis password the golden template names) and write nothing cluster-scoped
but namespaces. RBAC cannot say "only namespaces I created" of the two
writes the cluster-wide role keeps (a namespace, a RoleBinding of the run's
role), so the API server is told by a ValidatingAdmissionPolicy shipped
beside the roles (:data:`SHIPPED_GUARD_FILE`): it refuses the certifier's
writes outside namespaces labelled with a run, and preflight checks it is in
force (:func:`write_let_through`).
Discovery, ``/version`` and self-subject reviews are granted to every
authenticated user by Kubernetes' default roles and are not listed.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROLE_NAME = "rayproof-certifier"
# Bound by the run itself in each namespace it creates (a RoleBinding of that name).
RUN_ROLE_NAME = "rayproof-certifier-run"
SHIPPED_ROLE_FILE = f"clusters/rbac/{ROLE_NAME}.yaml"  # in the repository
SHIPPED_ROLE = Path(__file__).resolve().parents[1] / SHIPPED_ROLE_FILE
# The PriorityClass the suite's pods run at (profile suitePods.priorityClassName),
# which a platform's admins apply: the suite creates nothing cluster-scoped but namespaces.
SHIPPED_PRIORITY_CLASS_FILE = "clusters/rbac/rayproof-priorityclass.yaml"
SHIPPED_PRIORITY_CLASS = Path(__file__).resolve().parents[1] / SHIPPED_PRIORITY_CLASS_FILE
REGENERATE = f"python -m clusters.access > {SHIPPED_ROLE_FILE}"
# What makes the API server refuse the certifier any write outside its
# runs' namespaces (a ValidatingAdmissionPolicy and its binding).
SHIPPED_GUARD_FILE = "clusters/rbac/rayproof-certifier-guard.yaml"
SHIPPED_GUARD = Path(__file__).resolve().parents[1] / SHIPPED_GUARD_FILE
# Where preflight tries a write the guard must refuse: a namespace every cluster has.
GUARD_PROBE_NAMESPACE = "default"


@dataclass(frozen=True)
class Rule:
    group: str
    resources: tuple[str, ...]  # "pods/log" for a subresource
    verbs: tuple[str, ...]
    why: str
    names: tuple[str, ...] = ()  # resourceNames: only these objects
    # Not required by preflight: without it the certificate says what it took on trust.
    optional: bool = False


RULES = (
    # Bound cluster-wide (a ClusterRoleBinding): reads, namespaces with the
    # run's label, and binding the run's role in each of them.
    Rule("", ("namespaces",), ("create", "get", "list"),
         "each clause's team namespaces and the run's lease namespace: created with the run's label, found again "
         "by it (each is deleted through the run's role bound in it)"),
    Rule("rbac.authorization.k8s.io", ("rolebindings",), ("create",),
         f"binds {RUN_ROLE_NAME} to this identity in each namespace the run has just created, and nowhere else "
         "(the guard refuses it in any other namespace)"),
    Rule("rbac.authorization.k8s.io", ("clusterroles",), ("bind", "get"),
         f"binding {RUN_ROLE_NAME} without holding its verbs anywhere; preflight reads it", names=(RUN_ROLE_NAME,)),
    Rule("", ("pods",), ("get", "list"),
         "SEC-1 lists every pod for Ray ports on a node's own network (hostNetwork, hostPort)"),
    Rule("", ("services",), ("list",), "SEC-1 lists every Service for exposed Ray ports"),
    Rule("", ("nodes",), ("list",), "capacity, node health and addresses (SEC-1's NodePort probe)"),
    Rule("apps", ("deployments",), ("list",), "the KubeRay and Kueue versions in the certificate"),
    Rule("storage.k8s.io", ("storageclasses",), ("list",), "the checkpoint StorageClass the profile names"),
    Rule("scheduling.k8s.io", ("priorityclasses",), ("get",),
         "the suite pods' PriorityClass the profile names must exist and never preempt (preflight)"),
    Rule("networking.k8s.io", ("networkpolicies",), ("list",), "the platform's policies, only read"),
    Rule("networking.k8s.io", ("ingresses",), ("list",), "SEC-1 lists every Ingress for exposed Ray ports"),
    Rule("ray.io", ("rayjobs", "rayclusters", "rayservices"), ("get", "list"),
         "the workloads' state; the start-up sweep finds ended runs' Ray objects"),
    Rule("coordination.k8s.io", ("leases",), ("list",),
         "`clean` and certify's start-up sweep read every run's lease to tell ended runs from live ones on any host"),
    Rule("kueue.x-k8s.io", ("clusterqueues", "localqueues", "workloadpriorityclasses"), ("get",),
         "the platform's queues and priorities, read and never set"),
    Rule("", ("configmaps",), ("get",),
         "Kueue's live Configuration (kueue-system/kueue-manager-config, where an upstream install keeps it), "
         "compared with the waitForPodsReady the profile promises; without it that promise is taken on trust",
         names=("kueue-manager-config",), optional=True),
)

RUN_RULES = (
    # Granted in a namespace only once the run binds it there: every write
    # the certification makes, and the reads of its own namespaces' contents.
    Rule("", ("namespaces",), ("delete",), "the namespace itself, at the end of its clause or run"),
    Rule("", ("serviceaccounts",), ("get",), "a new namespace is usable once its default ServiceAccount exists"),
    Rule("", ("pods",), ("create", "delete", "deletecollection"),
         "probe, load and Redis pods; the preempted worker (TRN-1); pods left at teardown"),
    Rule("", ("pods/log",), ("get",), "training and probe events, evidence on failure"),
    Rule("", ("configmaps", "persistentvolumeclaims"), ("create",), "the workload files and the checkpoint claim"),
    Rule("", ("secrets",), ("create",),
         "the password Secret a golden template's GCS Redis names (redisPassword.valueFrom), created with a new "
         "random password where the platform has not made it; never read"),
    Rule("", ("services",), ("create",), "the Redis a team deploys for GCS fault tolerance"),
    Rule("", ("endpoints",), ("get",), "GCS-1 waits for the Serve Service's endpoints"),
    Rule("", ("events",), ("list",), "evidence: the events of the suite's namespaces"),
    Rule("batch", ("jobs",), ("list",), "KubeRay's submitter Jobs of the suite's RayJobs (ADM sampling)"),
    Rule("networking.k8s.io", ("networkpolicies",), ("create", "delete"),
         "the faults' deny policies (NET-1, NET-4, NET-3's probe), removed by the fault's rollback"),
    Rule("ray.io", ("rayjobs", "rayclusters", "rayservices"), ("create", "delete", "deletecollection", "patch"),
         "the workloads; patch drops finalizers that hold one of the suite's namespaces at teardown, and makes "
         "UPG-1's change to its RayService after the upgrade"),
    Rule("coordination.k8s.io", ("leases",), ("create", "patch", "delete"),
         "the run's lease, in the run's own namespace, renewed while the run lives"),
    Rule("kueue.x-k8s.io", ("workloads",), ("list",), "admission of the suite's RayJobs, sampled"),
)


def write_let_through(api: Any) -> str | None:
    """What the API server let this identity write outside its runs'
    namespaces, or None where it refused: a dry-run RoleBinding of the run's
    role in namespace ``default`` (admission runs, nothing is stored). RBAC
    allows it (the cluster-wide role binds the run's role in any namespace,
    so that a run can in its own); only the guard (:data:`SHIPPED_GUARD_FILE`)
    refuses it."""
    from kubernetes import client

    body = {"metadata": {"generateName": "rayproof-guard-probe-", "labels": {"app.kubernetes.io/name": "rayproof"}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RUN_ROLE_NAME},
            "subjects": [subject(api)]}
    try:
        client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(GUARD_PROBE_NAMESPACE, body, dry_run="All")
    except client.ApiException as exc:
        if exc.status in (403, 422):  # refused: by admission (the guard) or by RBAC
            return None
        if exc.status == 404:  # no such namespace here: nothing to write into, nothing to refuse
            return None
        raise
    return (f"a RoleBinding of {RUN_ROLE_NAME} in namespace {GUARD_PROBE_NAMESPACE} (dry run) was accepted: "
            "with it, every write of a run")


def checks(every: bool = False, rules: Sequence[Rule] = RULES) -> list[tuple[str, str, str, str, str]]:
    """Every (verb, group, resource, subresource, name) of ``rules`` (the
    cluster-wide ones by default) that preflight requires (``every``: the
    optional ones too); ``name`` is "" but for a rule limited to named
    objects, one check per name."""
    out = []
    for rule in rules:
        if rule.optional and not every:
            continue
        for resource in rule.resources:
            base, _, sub = resource.partition("/")
            out += [(verb, rule.group, base, sub, name) for verb in rule.verbs for name in rule.names or ("",)]
    return out


def run_role_gaps(api: Any) -> list[str]:
    """What the cluster's ClusterRole :data:`RUN_ROLE_NAME` lacks of
    :data:`RUN_RULES` ("verb group/resource"), or ``["the ClusterRole ... is
    not there"]``: read, since no namespace binds it before a run makes one."""
    from kubernetes import client

    try:
        role = client.RbacAuthorizationV1Api(api).read_cluster_role(RUN_ROLE_NAME)
    except client.ApiException as exc:
        if exc.status == 404:
            return [f"the ClusterRole {RUN_ROLE_NAME} is not there"]
        raise

    def granted(verb: str, group: str, resource: str) -> bool:
        return any(not rule.resource_names and {group, "*"} & set(rule.api_groups or [])
                   and {resource, "*"} & set(rule.resources or []) and {verb, "*"} & set(rule.verbs or [])
                   for rule in role.rules or [])

    return [f"{verb} {group + '/' if group else ''}{resource}{'/' + sub if sub else ''}"
            for verb, group, resource, sub, _ in checks(rules=RUN_RULES)
            if not granted(verb, group, f"{resource}/{sub}" if sub else resource)]


def username(api: Any) -> str:
    """This identity's username, as the API server knows it (a SelfSubjectReview)."""
    from kubernetes import client

    review = client.AuthenticationV1Api(api).create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    return str(review.status.user_info.username)


def subject(api: Any) -> dict[str, str]:
    """This identity as an RBAC subject (a ServiceAccount's username is
    ``system:serviceaccount:<namespace>:<name>``)."""
    name = username(api)
    parts = name.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
        return {"kind": "ServiceAccount", "name": parts[3], "namespace": parts[2]}
    return {"kind": "User", "name": name, "apiGroup": "rbac.authorization.k8s.io"}


def bind_run_role(api: Any, namespace: str, labels: dict[str, str]) -> None:
    """Bind :data:`RUN_ROLE_NAME` to this identity in ``namespace``, which
    the run has just created, and wait until the API server authorizes it
    there (its RBAC cache has the binding). Deleted with the namespace."""
    from kubernetes import client

    from core import timeouts
    from core.waiting import wait_for

    try:
        client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(namespace, {
            "metadata": {"name": RUN_ROLE_NAME, "labels": dict(labels)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RUN_ROLE_NAME},
            "subjects": [subject(api)]})
    except client.ApiException as exc:
        if exc.status != 409:  # already bound: another process of the run made the namespace
            raise
    authz = client.AuthorizationV1Api(api)

    def allowed() -> bool:
        return bool(authz.create_self_subject_access_review({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": "create", "resource": "pods", "namespace": namespace}}}
        ).status.allowed)

    wait_for(allowed, timeout=timeouts.CONTROLLER_RECONCILE, interval=0.2,
             description=f"the API server to authorize this identity in namespace {namespace} through the "
                         f"RoleBinding {RUN_ROLE_NAME}")


def _role_yaml(name: str, rules: Sequence[Rule], header: list[str]) -> list[str]:
    lines = [*header, "apiVersion: rbac.authorization.k8s.io/v1", "kind: ClusterRole", "metadata:",
             f"  name: {name}", "  labels:", "    app.kubernetes.io/name: rayproof", "rules:"]
    for rule in rules:
        lines += [
            f"  # {rule.why}",
            f"  - apiGroups: [\"{rule.group}\"]",
            f"    resources: [{', '.join(rule.resources)}]",
            *([f"    resourceNames: [{', '.join(rule.names)}]"] if rule.names else []),
            f"    verbs: [{', '.join(rule.verbs)}]",
        ]
    return lines


def cluster_role_yaml() -> str:
    """:data:`RULES` and :data:`RUN_RULES` as two ClusterRoles, each rule with its reason."""
    lines = _role_yaml(ROLE_NAME, RULES, [
        f"# The access rayproof's certification needs; generated from clusters/access.py ({REGENERATE}).",
        f"# Two ClusterRoles. Bind {ROLE_NAME} cluster-wide to the identity that runs",
        "# `rayproof certify --kubeconfig`, for example:",
        f"#   kubectl create clusterrolebinding {ROLE_NAME} --clusterrole={ROLE_NAME} --user=<who certifies>",
        f"# and never bind {RUN_ROLE_NAME} yourself: each run binds it, to its own identity, in each",
        "# namespace it creates, so every write it may make is granted in those namespaces only",
        "# (`kubectl auth can-i` answers no for them anywhere else).",
        "# No Secret is read (one is created: a GCS Redis password); nothing cluster-scoped written but namespaces.",
    ])
    lines += ["---"] + _role_yaml(RUN_ROLE_NAME, RUN_RULES, [
        f"# Bound by each run in each namespace it creates (RoleBinding {RUN_ROLE_NAME}); deleted with it.",
    ])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(cluster_role_yaml())
