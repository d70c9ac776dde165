"""The reference platform's namespace onboarding: what a labelled namespace gets.

The rendering is checked here without a cluster; the embedded platform's
onboarding of real namespaces is exercised by every Kubernetes clause (each
waits for its namespaces' LocalQueue over an Active ClusterQueue).
"""
from __future__ import annotations

import pytest

from clusters.embedded.onboarding.controller import (
    GPU_QUOTA_LABEL,
    MANAGED_BY,
    TENANT_LABEL,
    OnboardingError,
    plural,
    render,
    shipped_classes,
)
from core import profile as profile_mod


def _standard(namespace: str = "team-x", **labels: str) -> dict[str, dict]:
    return {d["kind"] + "/" + d["metadata"]["name"]: d for d in render(shipped_classes()["standard"], namespace, labels)}


def test_a_tenants_namespaces_share_one_cluster_queue_with_the_quota_asked_for() -> None:
    a = _standard("team-a", **{TENANT_LABEL: "t1", GPU_QUOTA_LABEL: "16"})
    b = _standard("team-b", **{TENANT_LABEL: "t1", GPU_QUOTA_LABEL: "16"})
    cq = a["ClusterQueue/tenant-t1"]
    assert "ClusterQueue/tenant-t1" in b
    assert cq["spec"]["namespaceSelector"] == {"matchLabels": {TENANT_LABEL: "t1"}}
    gpus = [r for r in cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"] if r["name"] == "nvidia.com/gpu"]
    assert gpus == [{"name": "nvidia.com/gpu", "nominalQuota": "16"}]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    assert a["LocalQueue/team"]["metadata"]["namespace"] == "team-a"
    assert a["LocalQueue/team"]["spec"]["clusterQueue"] == "tenant-t1"
    assert all(d["metadata"]["labels"][TENANT_LABEL] == "t1" and MANAGED_BY.items() <= d["metadata"]["labels"].items()
               for d in a.values())


def test_without_a_tenant_label_a_namespace_is_its_own_tenant_with_no_gpus() -> None:
    objs = _standard("solo")
    assert objs["LocalQueue/team"]["spec"]["clusterQueue"] == "tenant-solo"
    flavors = objs["ClusterQueue/tenant-solo"]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    assert {"name": "nvidia.com/gpu", "nominalQuota": "0"} in flavors


def test_the_policies_guard_heads_from_other_namespaces_and_admit_the_namespace_to_workers() -> None:
    objs = _standard()
    head, workers = objs["NetworkPolicy/ray-head-isolation"]["spec"], objs["NetworkPolicy/ray-workers"]["spec"]
    assert head["podSelector"] == {"matchLabels": {"ray.io/node-type": "head"}}
    open_ports = {p["port"] for rule in head["ingress"] if any("namespaceSelector" in peer for peer in rule["from"])
                  for p in rule.get("ports", [None])}
    assert open_ports == {8265, 8080}, "other namespaces reach only the metrics port and (the operator) the dashboard"
    blocks = {(peer["ipBlock"]["cidr"], p["port"]) for rule in head["ingress"] for peer in rule["from"]
              if "ipBlock" in peer for p in rule["ports"]}
    assert blocks == {("198.18.0.1/32", 8265)}, "the API server's service proxy (the operator's way in): the dashboard"
    assert workers["podSelector"] == {"matchLabels": {"ray.io/node-type": "worker"}}
    assert workers["ingress"][0] == {"from": [{"podSelector": {}}]}, "the design admits the whole namespace"


@pytest.mark.parametrize("labels, text, message", [
    ({GPU_QUOTA_LABEL: "lots"}, None, "must be a whole number of GPUs"),
    ({TENANT_LABEL: "-bad-"}, None, "is not a valid label value"),
    ({}, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "only objects of an API group"),
    ({}, "apiVersion: a.io/v1\nkind: X\nmetadata: {name: x, namespace: other}\n", "not the one onboarded"),
    ({}, "apiVersion: a.io/v1\nkind: X\nmetadata: {name: ${nope}}\n", "does not render"),
])
def test_a_class_that_cannot_be_applied_is_an_error_naming_why(labels: dict, text: str | None, message: str) -> None:
    with pytest.raises(OnboardingError, match=message):
        render(text or shipped_classes()["standard"], "team-x", labels)


def test_plural_names_of_the_kinds_a_class_holds() -> None:
    assert [plural(k) for k in ("ClusterQueue", "LocalQueue", "NetworkPolicy", "ResourceQuota", "Ingress")] == [
        "clusterqueues", "localqueues", "networkpolicies", "resourcequotas", "ingresses"]


def test_the_default_profile_points_teams_at_the_reference_onboarding() -> None:
    teams = profile_mod.load()["teams"]
    assert teams["namespaceLabels"] == {"onboarding.rayproof.io/class": "standard"}
    assert (teams["tenantLabel"], teams["gpuQuotaLabel"]) == (TENANT_LABEL, GPU_QUOTA_LABEL)
    assert teams["localQueue"] == "team" and "LocalQueue/team" in _standard()
