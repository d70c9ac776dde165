"""The suite's access: one table (clusters/access.py), checked by preflight and shipped as a ClusterRole."""
from __future__ import annotations

import yaml

from clusters import access

# Cluster-scoped resources; the suite writes none of them but namespaces.
CLUSTER_SCOPED = {("", "namespaces"), ("", "nodes"), ("storage.k8s.io", "storageclasses"),
                  ("kueue.x-k8s.io", "clusterqueues"), ("kueue.x-k8s.io", "workloadpriorityclasses")}
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def granted_by(role: dict) -> set[tuple[str, str, str]]:
    return {(verb, group, resource) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def checked(rules) -> set[tuple[str, str, str]]:
    return {(verb, group, resource + (f"/{sub}" if sub else ""))
            for verb, group, resource, sub, _ in access.checks(every=True, rules=rules)}


def test_the_shipped_cluster_roles_are_the_tables() -> None:
    assert access.SHIPPED_ROLE.read_text() == access.cluster_role_yaml(), (
        f"{access.SHIPPED_ROLE_FILE} differs from clusters/access.py; regenerate it: {access.REGENERATE}")
    certifier, run = yaml.safe_load_all(access.SHIPPED_ROLE.read_text())
    assert (certifier["metadata"]["name"], run["metadata"]["name"]) == (access.ROLE_NAME, access.RUN_ROLE_NAME)
    assert granted_by(certifier) == checked(access.RULES) and granted_by(run) == checked(access.RUN_RULES)
    # A rule limited to named objects reads one object, or binds the run's role.
    named = [rule for rule in certifier["rules"] if rule.get("resourceNames")]
    assert named and all(set(rule["verbs"]) <= {"get", "bind"} for rule in named), named
    assert all(not rule.get("resourceNames") for rule in run["rules"])


def test_the_roles_read_no_secret_and_write_nothing_cluster_scoped_but_namespaces() -> None:
    every = access.checks(every=True) + access.checks(every=True, rules=access.RUN_RULES)
    # It creates the GCS Redis password Secret a golden template names; it
    # never gets, lists, watches or changes one (another tenant's secrets).
    assert {verb for verb, _, resource, _, _ in every if resource == "secrets"} == {"create"}
    assert all("*" not in (verb, resource) for verb, _, resource, _, _ in every)
    writes = {(group, resource) for verb, group, resource, _, _ in every if verb in WRITES} & CLUSTER_SCOPED
    assert writes == {("", "namespaces")}, writes
    assert all(rule.why for rule in (*access.RULES, *access.RUN_RULES))


def test_bound_cluster_wide_the_certifier_writes_only_namespaces_and_its_runs_bindings() -> None:
    """What RBAC grants everywhere: every other write is the run's role's,
    granted in a namespace only once the run binds it there."""
    cluster_writes = {(verb, group, resource) for verb, group, resource, _, _ in access.checks(every=True)
                      if verb in WRITES | {"bind"}}
    assert cluster_writes == {("create", "", "namespaces"), ("create", "rbac.authorization.k8s.io", "rolebindings"),
                              ("bind", "rbac.authorization.k8s.io", "clusterroles")}, cluster_writes


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
