"""Other tenants' pods on a shared cluster: the suite's pods never preempt them.

On a one-node platform of its own (eight GPUs), another tenant runs a
low-priority pod holding every GPU, in a namespace the suite did not make.
The suite's pod asking for those GPUs, created as every suite pod is
(``Lab.create_pod``, at the profile's ``suitePods.priorityClassName``), is
left Pending by kube-scheduler, which says preemption is not allowed for it;
the tenant's pod runs on untouched. With the class unset (the one profile
change a user could make), the same pod preempts the tenant's: the check
can fail.
"""
from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import Any, Iterator

import pytest

from clusters import access
from clusters.embedded.nodes.images import busybox_version
from core import profile as profile_mod
from core import timeouts
from core.waiting import wait_for
from fixtures.kube import Lab
from tests.selftest.clause_runs import misconfigured_platform, platforms_group

pytestmark = [pytest.mark.slow, platforms_group(__name__)]
GPUS = "nvidia.com/gpu"
TENANT_CLASS = "tenant-batch-low"


def shell_image() -> str:
    """The shell image the platform's registry holds (a name it does not hold would never pull)."""
    return f"busybox:{busybox_version()}"


@pytest.fixture(scope="module")
def one_node(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Module scope; a platform of one eight-GPU node (taken down at the end),
    with a tenant's low-priority PriorityClass."""
    from kubernetes import client

    from clusters.embedded.platform import EmbeddedPlatform

    started = misconfigured_platform(pytestconfig, tmp_path_factory, "tenancy", {"nodes": {"count": 1}})
    name, _ = next(started)
    try:
        platform = EmbeddedPlatform(name)
        client.SchedulingV1Api(platform.api_client()).create_priority_class({
            "metadata": {"name": TENANT_CLASS}, "value": -1000, "description": "another tenant's batch work"})
        yield platform
    finally:
        started.close()  # takes the platform down


@pytest.fixture
def tenant_pod(one_node) -> Iterator[tuple[str, str]]:
    """Another tenant's pod holding all eight GPUs at low priority, made by
    the platform's admin in a namespace without the suite's labels."""
    from kubernetes import client

    core = client.CoreV1Api(one_node.api_client())
    ns = f"tenant-{secrets.token_hex(3)}"
    core.create_namespace({"metadata": {"name": ns}})
    core.create_namespaced_pod(ns, {"metadata": {"name": "batch"}, "spec": {
        "priorityClassName": TENANT_CLASS, "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "batch", "image": shell_image(), "command": ["sleep", "3600"],
                        "resources": {"limits": {GPUS: "8"}, "requests": {GPUS: "8"}}}]}})
    wait_for(lambda: core.read_namespaced_pod("batch", ns).status.phase, lambda phase: phase == "Running",
             timeout=timeouts.POD_START, description=f"the tenant's pod {ns}/batch to run")
    try:
        yield ns, "batch"
    finally:
        core.delete_namespace(ns)


def _suite_pod(platform: Any, profile: profile_mod.CertificationProfile) -> tuple[Lab, str, str]:
    """The suite's pod asking for eight GPUs, in a namespace of the suite's."""
    from kubernetes import client

    api = platform.api_client(certifier=True)
    stack = contextlib.ExitStack()
    lab = Lab(api, profile, "tenancy" + secrets.token_hex(2), "tenancy-" + secrets.token_hex(2), stack)
    ns = f"rp-{lab.key}-a"
    lab.core.create_namespace({"metadata": {"name": ns, "labels": lab.labels}})
    access.bind_run_role(api, ns, lab.labels)
    stack.callback(lambda: client.CoreV1Api(api).delete_namespace(ns))
    lab.create_pod(ns, {"metadata": {"name": "needs-gpus", "labels": lab.labels}, "spec": {
        "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "c", "image": shell_image(), "command": ["sleep", "3600"],
            "resources": {"limits": {GPUS: "8"}, "requests": {GPUS: "8"}}}]}})
    return lab, ns, "needs-gpus"


def _scheduling_events(platform: Any, ns: str, pod: str) -> list[str]:
    from kubernetes import client

    events = client.CoreV1Api(platform.api_client()).list_namespaced_event(
        ns, field_selector=f"involvedObject.name={pod}").items
    return [f"{e.reason}: {e.message}" for e in events]


def test_the_suites_pods_never_preempt_a_tenants_pod(one_node, tenant_pod) -> None:
    from kubernetes import client

    tenant_ns, tenant = tenant_pod
    core = client.CoreV1Api(one_node.api_client())
    lab, ns, pod = _suite_pod(one_node, profile_mod.load())
    with lab._stack:
        assert lab.core.read_namespaced_pod(pod, ns).spec.preemption_policy == "Never"
        events = wait_for(lambda: _scheduling_events(one_node, ns, pod),
                          lambda seen: any("preemptionPolicy=Never" in e for e in seen),
                          timeout=timeouts.CONTROLLER_RECONCILE,
                          description=f"kube-scheduler to refuse preemption for the suite's pod {ns}/{pod}")
        assert lab.core.read_namespaced_pod(pod, ns).status.phase == "Pending", events
        held = core.read_namespaced_pod(tenant, tenant_ns)
        assert held.status.phase == "Running" and not held.metadata.deletion_timestamp, held.status


def test_without_the_suites_class_its_pod_would_preempt_the_tenant(one_node, tenant_pod, tmp_path: Path) -> None:
    from kubernetes import client

    tenant_ns, tenant = tenant_pod
    core = client.CoreV1Api(one_node.api_client())
    lab, ns, pod = _suite_pod(one_node, profile_mod.load({"suitePods": {"priorityClassName": None}}))
    with lab._stack:

        def tenant_state() -> str:
            try:
                found = core.read_namespaced_pod(tenant, tenant_ns)
            except client.ApiException as exc:
                return "gone" if exc.status == 404 else f"HTTP {exc.status}"
            return "terminating" if found.metadata.deletion_timestamp else found.status.phase
        wait_for(tenant_state, lambda state: state in ("terminating", "gone"), timeout=timeouts.CONTROLLER_RECONCILE,
                 description=f"kube-scheduler to preempt the tenant's pod {tenant_ns}/{tenant} for {ns}/{pod}")
