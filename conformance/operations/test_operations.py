"""Operations and security: finished jobs give their GPUs back (OPS-1); Ray's
dashboard, Jobs API, client and GCS ports are not reachable from outside the
cluster (SEC-1); no team's Ray node can join another team's GCS (SEC-2)."""
from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

import pytest

from conformance.training_jobs import gang_gpus
from core import kueue, timeouts
from core.figures import BOUND_S
from core.profile import cluster_spec_in
from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for
from fixtures import manifests as mf
from fixtures.exposure import exposed_endpoints, probe_endpoints, tenant_names_hashed
from fixtures.kube import pod_ready
from fixtures.netprobe import port_probe_result, ray_join_attempt, ray_nodes_seen_from, start_port_probe

pytestmark = pytest.mark.slow

# OPS-1 keeps watching this long past its bound before it gives up.
TEARDOWN_OVERRUN_S = 30
# SEC-2 watches a refused node of another namespace until this many times the
# control's join time (at least the minimum) has passed since it was created.
FOREIGN_JOIN_FACTOR = 5
FOREIGN_JOIN_MIN_S = 60
# SEC-2's probes from team B: a plain pod, and one wearing the KubeRay
# operator's pod label (a label any tenant can put on its own pod).
OPERATOR_LABEL = {"app.kubernetes.io/name": "kuberay-operator"}
PORT_NAMES = {mf.GCS_PORT: "GCS", mf.DASHBOARD_PORT: "dashboard and Jobs API", mf.CLIENT_PORT: "Ray client"}

def _gpu_reserved(cq: dict) -> float:
    total = 0.0
    for flavor in (cq.get("status") or {}).get("flavorsReservation") or []:
        for res in flavor.get("resources") or []:
            if res.get("name") == "nvidia.com/gpu":
                total += float(str(res.get("total", "0")))
    return total


@pytest.mark.clause("OPS-1")
def test_finished_rayjob_cluster_is_torn_down(lab, evidence) -> None:
    """When a RayJob written from the platform's golden template finishes, its
    RayCluster and every one of its pods MUST be gone, and its GPUs back in
    the ClusterQueue (no reservation left), within the profile's
    operations.teardownWithin of the job's end time."""
    bound_s = lab.profile.seconds("operations.teardownWithin")
    ns = lab.namespace("a", gpus=gang_gpus(lab))
    cq = lab.cluster_queue
    name = lab.name("ops1")
    job = lab.rayjob(ns, name, mf.hold_entrypoint(5), queue=lab.queue)
    # The golden template's teardown settings, as the platform set them (never the suite).
    teardown = ("shutdownAfterJobFinishes", "ttlSecondsAfterFinished")  # platform-owned-ok: read, recorded
    evidence.record("template_teardown", {k: job["spec"].get(k) for k in teardown})
    lab.create_ray(ns, "rayjobs", job)
    status = lab.wait_rayjob(ns, name, lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                             timeout=timeouts.RAYCLUSTER_READY, description="finished")
    assert status.get("jobStatus") == "SUCCEEDED", f"the hold job {name} itself failed: {status}"
    cluster = status["rayClusterName"]
    ended = dt.datetime.fromisoformat(status["endTime"].replace("Z", "+00:00")).timestamp()

    def leftovers() -> dict:
        clusters = [c["metadata"]["name"] for c in lab.custom.list_namespaced_custom_object(
            "ray.io", "v1", ns, "rayclusters").get("items", []) if c["metadata"]["name"] == cluster]
        pods = [p.metadata.name for p in lab.pods(ns, f"ray.io/cluster={cluster}")]
        cq_obj = lab.custom.get_cluster_custom_object(
            kueue.GROUP, kueue.VERSION, "clusterqueues", cq)  # platform-owned-ok: read only, the quota it reserves
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
    evidence.record(BOUND_S, bound_s)
    evidence.record("final_state", left)
    assert gone_after <= bound_s, (
        f"RayJob {name}'s cluster took {gone_after} s after the job ended to be torn down (bound {bound_s:g} s): "
        "its GPUs stayed held by an idle cluster")


# SEC-1's RayService serves nothing: only its head and its Services are looked at.
NO_APPLICATIONS = "applications: []\n"


def _unauthenticated(probe: dict) -> str | None:
    """Why a probed address lets anyone in, or None: a connect to the GCS or
    client port is enough; the dashboard counts unless it answered 401/403."""
    if not probe["reachable"] or (probe["ray_port"] == mf.DASHBOARD_PORT and probe["http_status"] in (401, 403)):
        return None
    answer = f", answering GET /api/version with {probe['http_status']}" if probe["answered_http"] else ""
    return (f"Ray's {probe['surface']} of {probe['kind']} {probe['namespace']}/{probe['name']} is reachable from "
            f"outside the cluster at {probe['address']}:{probe['port']} ({probe['via']}{answer})")


@pytest.mark.clause("SEC-1")
def test_ray_dashboard_not_exposed_without_authentication(lab, evidence, request) -> None:
    """Ray's dashboard/Jobs API (8265), client port (10001) and GCS (6379)
    MUST NOT be reachable from outside the cluster without authentication: a
    RayCluster and a RayService, each from the platform's golden template,
    are started, and every address the cluster reports for a Ray control port
    of any Service (node addresses at NodePorts, LoadBalancer addresses,
    externalIPs, Ingress hosts) is probed from outside the cluster (the
    certifying host; on the embedded platform's real nodes, a namespace
    beside them that reaches nothing else); none may accept a connection
    (the dashboard may answer only 401 or 403)."""
    ns = lab.namespace("a")
    name, service = lab.name("sec1"), lab.name("sec1-serve")
    cluster = lab.raycluster(ns, name, workers=0)
    # Every golden template that makes a head: each has its own head Service settings.
    rayservice = lab.rayservice(ns, service, NO_APPLICATIONS, workers=0)
    evidence.record("head_service_type", {kind: cluster_spec_in(obj)["headGroupSpec"].get("serviceType",
                                                                                            "ClusterIP (default)")
                                          for kind, obj in (("rayCluster", cluster), ("rayService", rayservice))})
    lab.create_ray(ns, "rayclusters", cluster)
    lab.create_ray(ns, "rayservices", rayservice)
    # Probed once the heads serve, so a Service exposing one has a ready endpoint to reach.
    wait_for(lambda: lab.pods(ns, "ray.io/node-type=head"), lambda pods: sum(map(pod_ready, pods)) >= 2,
             timeout=timeouts.RAYCLUSTER_READY, interval=2,
             description=f"the heads of RayCluster {ns}/{name} and RayService {ns}/{service} to be Ready")
    head_svc = [s for s in lab.core.list_namespaced_service(ns).items if (s.metadata.labels or {}).get("ray.io/cluster")]
    evidence.record("head_services", [{"name": s.metadata.name, "type": s.spec.type,
                                       "ports": [p.port for p in s.spec.ports or []]} for s in head_svc])
    endpoints = exposed_endpoints(lab.core, lab.net)
    probes = lab.outside(lambda: probe_endpoints(endpoints))
    if not request.config.getoption("--reveal-tenant-names"):  # other tenants' objects, as a published certificate shows them
        endpoints, probes = (tenant_names_hashed(items, lab.namespaces) for items in (endpoints, probes))
    evidence.record("exposed_endpoints", endpoints)
    evidence.record("probes", probes)
    open_doors = [why for why in map(_unauthenticated, probes) if why]
    assert not open_doors, "Ray control ports are reachable from outside the cluster: " + "; ".join(open_doors)


@dataclass(frozen=True)
class JoinAttempts:
    """What SEC-2's join attempts and port probes against team A's head saw."""

    ports: list[int]  # every Ray port of the head
    ip: str  # the head pod's IP, where the ports were probed
    foreign: dict[str, Any]  # the join attempt from team B's namespace
    seen: dict[str, Any]  # the head's ports as each probe pod found them, by where it ran


def start_team_a_cluster(lab: Any, evidence: Any, ns_a: str, cluster: str) -> tuple[Any, str, str]:
    """Team A's RayCluster from the golden template, its head Ready and recorded; the head pod, its Service's
    host name and its GCS address."""
    with evidence.phase("team A's cluster"):
        lab.create_ray(ns_a, "rayclusters", lab.raycluster(ns_a, cluster, workers=0))
        head = wait_for(lambda: [p for p in lab.pods(ns_a, f"ray.io/cluster={cluster},ray.io/node-type=head")
                                 if pod_ready(p)],
                        timeout=timeouts.RAYCLUSTER_READY, interval=2,
                        description=f"the head of RayCluster {ns_a}/{cluster} to be Ready")[0]
        service = next(s.metadata.name for s in lab.core.list_namespaced_service(ns_a).items
                       if (s.metadata.labels or {}).get("ray.io/cluster") == cluster
                       and (s.metadata.labels or {}).get("ray.io/node-type") == "head")
        host = f"{service}.{ns_a}.svc.cluster.local"
        gcs = f"{host}:{mf.GCS_PORT}"
        evidence.record("team_a_head", {"pod": head.metadata.name, "ip": head.status.pod_ip, "service": host})
    return head, host, gcs


def attempt_joins(lab: Any, evidence: Any, ns_a: str, ns_b: str, head: Any, gcs: str) -> JoinAttempts:
    """Join attempts: a Ray node joining ``gcs`` from team A's namespace (the control, which must join) and
    from team B's, while pods of both namespaces probe every Ray port of the head; all recorded."""
    with evidence.phase("join attempts"):
        # Every Ray port of the head, tried from both namespaces while the joins run.
        ports, ip = list(mf.HEAD_PORTS), head.status.pod_ip
        probes = {"from_own_namespace": (ns_a, start_port_probe(lab, ns_a, ip, ports)),
                  "from_other_namespace": (ns_b, start_port_probe(lab, ns_b, ip, ports)),
                  "from_other_namespace_as_the_operator": (ns_b, start_port_probe(lab, ns_b, ip, ports,
                                                                                  labels=OPERATOR_LABEL))}
        control = evidence.record("join_from_own_namespace",
                                  ray_join_attempt(lab, ns_a, lab.name("join-own"), gcs))
        assert control["joined"], (
            f"a Ray node in team A's own namespace {ns_a} could not join its GCS at {gcs}, so the probe shows "
            f"nothing about isolation: {control}")
        # A refused node retries for minutes: once refused, it is given several
        # times what the control needed to join before it counts as kept out.
        foreign = evidence.record("join_from_other_namespace", ray_join_attempt(
            lab, ns_b, lab.name("join-foreign"), gcs,
            refused_for_s=max(FOREIGN_JOIN_MIN_S, FOREIGN_JOIN_FACTOR * control["seconds"])))
        seen = evidence.record("head_ports", {"ip": ip, **{k: port_probe_result(lab, n, pod)
                                                             for k, (n, pod) in probes.items()}})
    return JoinAttempts(ports=ports, ip=ip, foreign=foreign, seen=seen)


def team_a_strangers(lab: Any, evidence: Any, ns_a: str, host: str) -> list[dict[str, Any]]:
    """Team A's view: the nodes its GCS lists (recorded); those alive that are not pods of ``ns_a``."""
    with evidence.phase("team A's view"):
        nodes = evidence.record("team_a_gcs_nodes", ray_nodes_seen_from(lab, ns_a, f"{host}:{mf.DASHBOARD_PORT}"))
        team_a_ips = {p.status.pod_ip for p in lab.pods(ns_a) if p.status.pod_ip}
        strangers = [n for n in nodes if n["state"] == "ALIVE" and n["ip"] not in team_a_ips]
    return strangers


def judge_isolation(ns_a: str, ns_b: str, gcs: str, joins: JoinAttempts, strangers: list[dict[str, Any]]) -> None:
    """Fail unless team B's node was refused and never joined, no pod of team B's namespace opened a port of
    the head that a pod of team A's opened, and team A's GCS lists no live node of another namespace."""
    ports, ip, foreign, seen = joins.ports, joins.ip, joins.foreign, joins.seen
    assert not foreign["joined"], (
        f"a Ray node started in team B's namespace {ns_b} joined team A's GCS at {gcs} "
        f"{foreign['seconds']} s after it started: the namespaces are not isolated (no NetworkPolicy or Ray "
        "authentication of the platform keeps other namespaces away from the head)")
    assert foreign["refused"], (
        f"the Ray node started in team B's namespace {ns_b} neither joined team A's GCS nor showed a refused "
        f"connection within {timeouts.RAY_JOIN.seconds:g} s, so isolation was not shown: {foreign}")
    reached = [p for p, o in seen["from_own_namespace"]["ports"].items() if o["open"]]
    assert reached, (f"a pod of team A's own namespace {ns_a} opened none of its head's ports {ports} at {ip}, so the "
                     f"probe shows nothing about isolation: {seen['from_own_namespace']['ports']}")
    let_in = {who: [p for p in reached if seen[who]["ports"][p]["open"]]
              for who in ("from_other_namespace", "from_other_namespace_as_the_operator")}
    assert not any(let_in.values()), (
        "team A's head is reachable from team B's namespace: " + "; ".join(
            f"{', '.join(PORT_NAMES.get(p, str(p)) + f' ({p})' for p in found)} opened by a pod of {ns_b}"
            f"{' wearing the label ' + str(OPERATOR_LABEL) if 'operator' in who else ''}"
            for who, found in let_in.items() if found)
        + " (no NetworkPolicy or Ray authentication of the platform keeps other namespaces away from the head)")
    assert not strangers, f"team A's GCS lists live nodes that are not pods of {ns_a}: {strangers}"


@pytest.mark.clause("SEC-2")
def test_no_ray_node_joins_another_teams_gcs(lab, evidence) -> None:
    """Teams MUST be isolated at the cluster level: a Ray node started in team
    B's namespace (another tenant of the platform, with its own
    ClusterQueue) MUST be refused by the GCS of team A's RayCluster (from the
    platform's golden template, in a namespace its onboarding provisioned) and
    never join it, while the same node started in team A's own namespace joins
    (the probe's control); a pod of team B's namespace, whether plain or
    wearing the KubeRay operator's pod label, MUST open none of the head's
    Ray ports (GCS 6379, dashboard and Jobs API 8265, client 10001) that a
    pod of team A's namespace opens in the same window; and team A's GCS MUST
    list only nodes that are pods of team A's namespace. What keeps them apart
    is the platform's (its NetworkPolicies, Ray authentication); the policies
    are recorded."""
    ns_a, ns_b = lab.namespace("a"), lab.namespace("b", own_tenant=True)  # another tenant: its own ClusterQueue
    cluster = lab.name("team-a")
    evidence.record("policies", {ns: [p.metadata.name for p in lab.net.list_namespaced_network_policy(ns).items]
                                 for ns in (ns_a, ns_b)})  # platform-owned-ok: read
    head, host, gcs = start_team_a_cluster(lab, evidence, ns_a, cluster)
    joins = attempt_joins(lab, evidence, ns_a, ns_b, head, gcs)
    strangers = team_a_strangers(lab, evidence, ns_a, host)
    judge_isolation(ns_a, ns_b, gcs, joins, strangers)
