"""The suite's access: one table (clusters/access.py), checked by preflight and shipped as a ClusterRole."""
from __future__ import annotations

import yaml

from clusters import access

# Cluster-scoped resources; the suite writes none of them but namespaces.
CLUSTER_SCOPED = {("", "namespaces"), ("", "nodes"), ("storage.k8s.io", "storageclasses"),
                  ("kueue.x-k8s.io", "clusterqueues"), ("kueue.x-k8s.io", "workloadpriorityclasses")}
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def test_the_shipped_cluster_role_is_the_table() -> None:
    assert access.SHIPPED_ROLE.read_text() == access.cluster_role_yaml(), (
        f"{access.SHIPPED_ROLE_FILE} differs from clusters/access.py; regenerate it: {access.REGENERATE}")
    role = yaml.safe_load(access.SHIPPED_ROLE.read_text())
    granted = {(verb, group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    checked = {(verb, group, resource + (f"/{sub}" if sub else ""))
               for verb, group, resource, sub in access.checks(every=True)}
    assert granted == checked
    # An optional rule is one object's read, never a kind's.
    named = [rule for rule in role["rules"] if rule.get("resourceNames")]
    assert named and all(rule["verbs"] == ["get"] for rule in named), named


def test_the_role_reads_no_secret_and_writes_nothing_cluster_scoped_but_namespaces() -> None:
    checks = access.checks(every=True)
    # It creates the GCS Redis password Secret a golden template names; it
    # never gets, lists, watches or changes one (another tenant's secrets).
    assert {verb for verb, _, resource, _ in checks if resource == "secrets"} == {"create"}
    assert all("*" not in (verb, resource) for verb, _, resource, _ in checks)
    writes = {(group, resource) for verb, group, resource, _ in checks if verb in WRITES} & CLUSTER_SCOPED
    assert writes == {("", "namespaces")}, writes
    assert all(rule.why for rule in access.RULES)


def test_the_shipped_guard_confines_the_shipped_role_by_username():
    """The ValidatingAdmissionPolicy beside the ClusterRole names the identity
    the embedded platform binds the role to, and its binding denies."""
    import yaml

    policy, binding = yaml.safe_load_all(access.SHIPPED_GUARD.read_text())
    assert (policy["kind"], binding["kind"]) == ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert f"['{access.ROLE_NAME}']" in policy["spec"]["matchConditions"][0]["expression"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert {"CREATE", "UPDATE", "DELETE"} <= set(policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"])
