"""Operations and security: finished jobs give their GPUs back (OPS-1); Ray's
dashboard and Jobs API are not reachable from outside the cluster (SEC-1)."""
from __future__ import annotations

import datetime as dt
import time

import pytest

from conformance.training_jobs import gang_gpus
from fixtures import manifests as mf
from fixtures import timeouts
from fixtures.timeouts import Tier
from fixtures.waiting import WaitTimeout, wait_for

pytestmark = pytest.mark.slow

# OPS-1 keeps watching this long past its bound before it gives up.
TEARDOWN_OVERRUN_S = 30
# Ports of Ray's control surfaces (REFERENCE: dashboard + Jobs API 8265, Ray client 10001).
RAY_CONTROL_PORTS = {8265: "dashboard/Jobs API", 10001: "Ray client"}
# Ingress annotations that put authentication in front of a backend.
AUTH_ANNOTATIONS = ("nginx.ingress.kubernetes.io/auth-url", "nginx.ingress.kubernetes.io/auth-type",
                    "nginx.ingress.kubernetes.io/auth-signin", "alb.ingress.kubernetes.io/auth-type",
                    "traefik.ingress.kubernetes.io/router.middlewares", "konghq.com/plugins")


def _gpu_reserved(cq: dict) -> float:
    total = 0.0
    for flavor in (cq.get("status") or {}).get("flavorsReservation") or []:
        for res in flavor.get("resources") or []:
            if res.get("name") == "nvidia.com/gpu":
                total += float(str(res.get("total", "0")))
    return total


@pytest.mark.clause("OPS-1")
def test_finished_rayjob_cluster_is_torn_down(lab, evidence) -> None:
    """When a RayJob finishes, its RayCluster and every one of its pods MUST be
    gone, and its GPUs back in the ClusterQueue (no reservation left), within
    the profile's operations.teardownWithin of the job's end time."""
    bound_s = lab.profile.seconds("operations.teardownWithin")
    ns = lab.namespace("a")
    lab.queues([ns], gpus=gang_gpus(lab))
    cq = f"rp-{lab.key}"
    name = lab.name("ops1")
    spec = mf.raycluster_spec(lab.profile, lab.labels, workers=2)
    lab.create_ray(ns, "rayjobs", mf.rayjob(name, lab.labels, mf.hold_entrypoint(5), spec, queue="team",
                                            ttl_s=int(lab.profile["operations"]["ttlSecondsAfterFinished"])))
    status = lab.wait_rayjob(ns, name, lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                             timeout=timeouts.RAYCLUSTER_READY, description="finished")
    assert status.get("jobStatus") == "SUCCEEDED", f"the hold job {name} itself failed: {status}"
    cluster = status["rayClusterName"]
    ended = dt.datetime.fromisoformat(status["endTime"].replace("Z", "+00:00")).timestamp()

    def leftovers() -> dict:
        clusters = [c["metadata"]["name"] for c in lab.custom.list_namespaced_custom_object(
            "ray.io", "v1", ns, "rayclusters").get("items", []) if c["metadata"]["name"] == cluster]
        pods = [p.metadata.name for p in lab.pods(ns, f"ray.io/cluster={cluster}")]
        cq_obj = lab.custom.get_cluster_custom_object(mf.KUEUE, mf.KUEUE_VERSION, "clusterqueues", cq)
        return {"rayclusters": clusters, "pods": pods, "gpus_reserved": _gpu_reserved(cq_obj)}

    # Waits a little past the bound, so a teardown just over it is measured, not just flagged.
    patience = Tier("teardown", bound_s + TEARDOWN_OVERRUN_S, "a finished RayJob's cluster torn down")
    try:
        left = wait_for(leftovers, lambda v: not v["rayclusters"] and not v["pods"] and v["gpus_reserved"] == 0,
                        timeout=patience, interval=0.5,
                        description=f"RayJob {name}'s cluster {cluster} gone and its GPUs returned")
    except WaitTimeout as exc:
        evidence.record("final_state", exc.last_value)
        pytest.fail(f"RayJob {name}'s cluster {cluster} was still there {time.time() - ended:.0f} s after the job "
                    f"ended (bound {bound_s:g} s): its GPUs stayed held by an idle cluster; left: {exc.last_value}")
    gone_after = round(time.time() - ended, 1)
    evidence.record("teardown_after_end_s", gone_after)
    evidence.record("bound_s", bound_s)
    evidence.record("final_state", left)
    assert gone_after <= bound_s, (
        f"RayJob {name}'s cluster took {gone_after} s after the job ended to be torn down (bound {bound_s:g} s): "
        "its GPUs stayed held by an idle cluster")


def _exposures(lab) -> list[str]:
    """Services and Ingresses (all namespaces) that expose a Ray control port outside the cluster."""
    found = []
    for svc in lab.core.list_service_for_all_namespaces().items:
        ports = {p.port: p for p in svc.spec.ports or []}
        ray_ports = [(port, what) for port, what in RAY_CONTROL_PORTS.items()
                     if port in ports or any((p.target_port == port) for p in ports.values())]
        if not ray_ports:
            continue
        where = f"Service {svc.metadata.namespace}/{svc.metadata.name}"
        if svc.spec.type in ("NodePort", "LoadBalancer"):
            found.append(f"{where} is type {svc.spec.type} exposing {', '.join(w for _, w in ray_ports)}")
        if svc.spec.external_ips:
            found.append(f"{where} has externalIPs {svc.spec.external_ips}")
    ray_services = {(s.metadata.namespace, s.metadata.name) for s in lab.core.list_service_for_all_namespaces().items
                    if any(p.port in RAY_CONTROL_PORTS for p in s.spec.ports or [])}
    for ing in lab.net.list_ingress_for_all_namespaces().items:
        annotations = ing.metadata.annotations or {}
        if any(a in annotations for a in AUTH_ANNOTATIONS):
            continue
        for rule in ing.spec.rules or []:
            for path in (rule.http.paths if rule.http else []):
                svc = path.backend.service
                if svc and (ing.metadata.namespace, svc.name) in ray_services:
                    found.append(f"Ingress {ing.metadata.namespace}/{ing.metadata.name} routes {path.path or '/'} "
                                 f"to {svc.name} without an authentication annotation")
    return found


@pytest.mark.clause("SEC-1")
def test_ray_dashboard_not_exposed_without_authentication(lab, evidence) -> None:
    """Ray's dashboard/Jobs API (8265) and client port (10001) MUST NOT be
    reachable from outside the cluster without authentication: a RayCluster
    written as the platform writes them gets only a ClusterIP head Service, and
    no Service in any namespace exposes those ports as NodePort, LoadBalancer
    or externalIPs, nor does any Ingress route to them without an
    authentication annotation."""
    ns = lab.namespace("a")
    name = lab.name("sec1")
    lab.create_ray(ns, "rayclusters", {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                                       "metadata": {"name": name, "labels": lab.labels},
                                       "spec": mf.raycluster_spec(lab.profile, lab.labels, workers=0)})
    head_svc = wait_for(lambda: [s for s in lab.core.list_namespaced_service(ns).items
                                 if (s.metadata.labels or {}).get("ray.io/cluster") == name],
                        timeout=timeouts.CONTROLLER_RECONCILE, description=f"KubeRay's Services for RayCluster {name}")
    evidence.record("head_services", [{"name": s.metadata.name, "type": s.spec.type,
                                       "ports": [p.port for p in s.spec.ports or []]} for s in head_svc])
    exposures = evidence.record("exposures", _exposures(lab))
    assert not exposures, "Ray control ports are exposed outside the cluster: " + "; ".join(exposures)
