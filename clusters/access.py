"""What the suite may do on a cluster: one table, read by preflight and rendered as the shipped ClusterRole.

:data:`RULES` lists every API access the certification makes, each with the
reason. Preflight asks the API server (self-subject access reviews) for each
verb of each rule before it creates anything; ``clusters/rbac/`` ships the
same table as a ClusterRole (``python -m clusters.access`` writes it; a test
keeps the file and the table equal). The embedded platform certifies with an
identity bound to that ClusterRole and nothing else, so every certification
of it shows the role is enough.

The role reads no Secrets (it creates one: a GCS Redis password the golden
template names), creates nothing cluster-scoped but namespaces, and writes
only in the namespaces the suite creates. Kubernetes RBAC cannot say "only
namespaces I created", so the API server is told by a ValidatingAdmissionPolicy
shipped beside the role (:data:`SHIPPED_GUARD_FILE`): it refuses the
certifier's writes outside namespaces labelled with a run, and preflight
checks it is in force (:func:`write_let_through`).
Discovery, ``/version`` and self-subject reviews are granted to every
authenticated user by Kubernetes' default roles and are not listed.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLE_NAME = "rayproof-certifier"
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
    Rule("", ("namespaces",), ("create", "get", "list", "delete"),
         "each clause's team namespaces and the run's lease namespace: created with the run's label, found again "
         "by it, deleted at the end (and by a later run's sweep once the run's lease expired)"),
    Rule("", ("serviceaccounts",), ("get",), "a new namespace is usable once its default ServiceAccount exists"),
    Rule("", ("pods",), ("create", "get", "list", "delete", "deletecollection"),
         "probe, load and Redis pods; the preempted worker (TRN-1); pods left at teardown"),
    Rule("", ("pods/log",), ("get",), "training and probe events, evidence on failure"),
    Rule("", ("configmaps", "persistentvolumeclaims"), ("create",), "the workload files and the checkpoint claim"),
    Rule("", ("secrets",), ("create",),
         "the password Secret a golden template's GCS Redis names (redisPassword.valueFrom), created with a new "
         "random password where the platform has not made it; never read"),
    Rule("", ("services",), ("create", "list"),
         "the Redis a team deploys for GCS fault tolerance; SEC-1 lists every Service for exposed Ray ports"),
    Rule("", ("endpoints",), ("get",), "GCS-1 waits for the Serve Service's endpoints"),
    Rule("", ("events",), ("list",), "evidence: the events of the suite's namespaces"),
    Rule("", ("nodes",), ("list",), "capacity, node health and addresses (SEC-1's NodePort probe)"),
    Rule("apps", ("deployments",), ("list",), "the KubeRay and Kueue versions in the certificate"),
    Rule("batch", ("jobs",), ("list",), "KubeRay's submitter Jobs of the suite's RayJobs (ADM sampling)"),
    Rule("storage.k8s.io", ("storageclasses",), ("list",), "the checkpoint StorageClass the profile names"),
    Rule("scheduling.k8s.io", ("priorityclasses",), ("get",),
         "the suite pods' PriorityClass the profile names must exist and never preempt (preflight)"),
    Rule("networking.k8s.io", ("networkpolicies",), ("create", "list", "delete"),
         "the faults' deny policies (NET-1, NET-4, NET-3's probe), removed by the fault's rollback; "
         "the platform's policies are only read"),
    Rule("networking.k8s.io", ("ingresses",), ("list",), "SEC-1 lists every Ingress for exposed Ray ports"),
    Rule("ray.io", ("rayjobs", "rayclusters", "rayservices"),
         ("create", "get", "list", "delete", "deletecollection", "patch"),
         "the workloads; patch only drops finalizers that hold one of the suite's namespaces at teardown"),
    Rule("coordination.k8s.io", ("leases",), ("create", "list", "patch", "delete"),
         "each run's lease, in the run's own namespace: renewed while the run lives, read by `clean` and by "
         "certify's start-up sweep to tell ended runs from live ones on any host"),
    Rule("kueue.x-k8s.io", ("clusterqueues", "localqueues", "workloadpriorityclasses"), ("get",),
         "the platform's queues and priorities, read and never set"),
    Rule("kueue.x-k8s.io", ("workloads",), ("list",), "admission of the suite's RayJobs, sampled"),
    Rule("", ("configmaps",), ("get",),
         "Kueue's live Configuration (kueue-system/kueue-manager-config, where an upstream install keeps it), "
         "compared with the waitForPodsReady the profile promises; without it that promise is taken on trust",
         names=("kueue-manager-config",), optional=True),
)


def write_let_through(api: Any) -> str | None:
    """What the API server let this identity write outside its runs'
    namespaces, or None where it refused: a dry-run ConfigMap in namespace
    ``default`` (admission runs, nothing is stored). RBAC allows it (the
    ClusterRole creates ConfigMaps wherever it is bound); only the guard
    (:data:`SHIPPED_GUARD_FILE`) or a narrower binding refuses it."""
    from kubernetes import client

    body = {"metadata": {"generateName": "rayproof-guard-probe-", "labels": {"app.kubernetes.io/name": "rayproof"}}}
    try:
        client.CoreV1Api(api).create_namespaced_config_map(GUARD_PROBE_NAMESPACE, body, dry_run="All")
    except client.ApiException as exc:
        if exc.status in (403, 422):  # refused: by admission (the guard) or by RBAC
            return None
        if exc.status == 404:  # no such namespace here: nothing to write into, nothing to refuse
            return None
        raise
    return f"a ConfigMap in namespace {GUARD_PROBE_NAMESPACE} (dry run) was accepted"


def checks(every: bool = False) -> list[tuple[str, str, str, str]]:
    """Every (verb, group, resource, subresource) of :data:`RULES` that
    preflight requires (``every``: the optional ones too)."""
    out = []
    for rule in RULES:
        if rule.optional and not every:
            continue
        for resource in rule.resources:
            base, _, sub = resource.partition("/")
            out += [(verb, rule.group, base, sub) for verb in rule.verbs]
    return out


def cluster_role_yaml() -> str:
    """:data:`RULES` as a ClusterRole manifest, each rule with its reason."""
    lines = [
        f"# The access rayproof's certification needs; generated from clusters/access.py ({REGENERATE}).",
        "# Bind it to the identity that runs `rayproof certify --kubeconfig`, for example:",
        f"#   kubectl create clusterrolebinding {ROLE_NAME} --clusterrole={ROLE_NAME} --user=<who certifies>",
        "# No Secret is read (one is created: a GCS Redis password); nothing cluster-scoped written but namespaces.",
        "apiVersion: rbac.authorization.k8s.io/v1",
        "kind: ClusterRole",
        "metadata:",
        f"  name: {ROLE_NAME}",
        "  labels:",
        "    app.kubernetes.io/name: rayproof",
        "rules:",
    ]
    for rule in RULES:
        lines += [
            f"  # {rule.why}",
            f"  - apiGroups: [\"{rule.group}\"]",
            f"    resources: [{', '.join(rule.resources)}]",
            *([f"    resourceNames: [{', '.join(rule.names)}]"] if rule.names else []),
            f"    verbs: [{', '.join(rule.verbs)}]",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(cluster_role_yaml())
