"""The KubeRay operator upgraded under running workloads (UPG-1), as
`certify --upgrade-to VERSION` asks between its two certifications."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from clusters import UpgradeFailed
from conformance.serving import (
    LOAD_RATE,
    REQUEST_TIMEOUT_S,
    SERVE_PORT,
    SERVICE_UP,
    apps_running,
    deleted_first,
    load_seconds,
    load_window,
    serve_config,
    serve_endpoints,
    service_sample,
    start_load,
)
from conformance.training_jobs import DriverLog, gang_gpus, training_rayjob
from core import timeouts
from core.waiting import wait_for
from fixtures.plugin import NOT_APPLICABLE

pytestmark = pytest.mark.slow

# The training runs far longer than any upgrade (it is judged, then deleted):
# on an existing cluster a person upgrades the operator while it runs.
STEPS, STEP_TIME_S = 100_000, 0.5
STEPS_BEFORE = 3  # the steady state: the training is stepping
STEPS_AFTER = 5  # steps the training must take under the new operator
TAIL_S = 30.0  # load and training are watched this long past the new operator's readiness


def ray_object(lab: Any, ns: str, plural: str, name: str) -> dict[str, Any]:
    obj = lab.ray(ns, plural, name)
    return {"uid": obj["metadata"]["uid"], "generation": obj["metadata"].get("generation"),
            "status": {k: v for k, v in (obj.get("status") or {}).items()
                       if k in ("jobStatus", "jobDeploymentStatus", "rayClusterName", "failed", "succeeded")}}


def raycluster_uids(lab: Any, ns: str) -> dict[str, str]:
    return {c["metadata"]["name"]: c["metadata"]["uid"] for c in lab.ray_objects(ns, "rayclusters")}


def workload_uids(lab: Any, ns_train: str, job_name: str, ns_serve: str, service_name: str) -> dict[str, str]:
    """The uid of each Ray object the two workloads are, by "Kind ns/name":
    the training's RayJob and RayClusters, and the RayService (its cluster
    may be rolled onto a new one). An object that is gone is absent."""
    found = {}
    for kind, ns, plural, name in (("RayJob", ns_train, "rayjobs", job_name),
                                   ("RayService", ns_serve, "rayservices", service_name)):
        for obj in lab.ray_objects(ns, plural):
            if obj["metadata"]["name"] == name:
                found[f"{kind} {ns}/{name}"] = obj["metadata"]["uid"]
    found.update({f"RayCluster {ns_train}/{name}": uid for name, uid in raycluster_uids(lab, ns_train).items()})
    return found


def kept(before: dict[str, str], now: dict[str, str], moment: str) -> None:
    """Fail unless every workload object of ``before`` is still there, the same object."""
    deleted = sorted(k for k in before if k not in now)
    replaced = sorted(k for k in before if k in now and now[k] != before[k])
    assert not deleted and not replaced, (
        f"{moment} the Ray objects of the running workloads were not kept: deleted {deleted}, replaced by new "
        f"ones {replaced}")


def a_teams_next_change(lab: Any, ns: str, name: str) -> dict[str, Any]:
    """A team's next change to its RayService once the operator is upgraded (a
    new Serve config: each deployment's ``max_ongoing_requests``), and the
    upgraded operator taking it up: it reconciles the new generation
    (``status.observedGeneration``) within ``controller_reconcile``. An
    operator that no longer watches the team's namespace never does, though
    every running pod and request goes on without it."""
    config = yaml.safe_load(serve_config(1))
    for app in config["applications"]:
        for deployment in app.get("deployments", []):
            deployment["max_ongoing_requests"] = 8
    changed = lab.custom.patch_namespaced_custom_object(
        "ray.io", "v1", ns, "rayservices", name, {"spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False)}})
    generation = changed["metadata"]["generation"]
    observed = wait_for(lambda: (lab.ray(ns, "rayservices", name).get("status") or {}).get("observedGeneration"),
                        lambda seen: (seen or 0) >= generation, timeout=timeouts.CONTROLLER_RECONCILE, interval=1,
                        description=f"the upgraded KubeRay operator to reconcile RayService {ns}/{name} changed by "
                                    f"its team (status.observedGeneration to reach generation {generation}): "
                                    "the upgraded operator does not reconcile the tenants' Ray objects")
    return {"generation": generation, "observed_generation": observed}


def step_numbers(log: DriverLog, refresh: bool = False) -> list[int]:
    """The training's step numbers so far (read afresh from its driver with ``refresh``)."""
    if refresh:
        log.refresh()
    return [int(e["step"]) for e in log.events("step")]


@pytest.fixture
def upgrade_to(request: pytest.FixtureRequest) -> str:
    """Function scope; the KubeRay version `--upgrade-to` names, or the clause
    is not applicable: asked before the lab, so a certification that upgrades
    nothing holds no share of the cluster for it (nothing to clean up)."""
    version = request.config.getoption("--upgrade-to")
    if not version:
        pytest.skip(f"{NOT_APPLICABLE} no KubeRay operator upgrade was requested (certify --upgrade-to VERSION)")
    return version


@dataclass(frozen=True)
class Workloads:
    """UPG-1's running workloads: the training RayJob ``ns_train/job_name`` and the RayService
    ``ns_serve/service_name`` under load."""

    ns_train: str
    job_name: str
    ns_serve: str
    service_name: str


@dataclass(frozen=True)
class UpgradeRun:
    """What the operator upgrade did: when it began, the training's steps then, the target's report of it
    (``{"failed": ...}`` where it raised UpgradeFailed), and when the new operator was ready."""

    began: float
    steps_at_start: int
    upgrade: dict[str, Any]
    ready_at: float


def start_load_and_training(lab: Any, evidence: Any, w: Workloads) -> tuple[DriverLog, str]:
    """Steady state: the RayService's apps running and answering the load generator, and the training RayJob
    stepping; the training's driver log and the load generator's pod."""
    with evidence.phase("steady state"):
        wait_for(lambda: service_sample(lab, w.ns_serve, w.service_name), lambda s: s["cluster"] and apps_running(s),
                 timeout=SERVICE_UP, interval=2, description=f"RayService {w.ns_serve}/{w.service_name} apps RUNNING")
        serve_svc = f"{w.service_name}-serve-svc"
        wait_for(lambda: serve_endpoints(lab, w.ns_serve, serve_svc), timeout=timeouts.SERVE_APP,
                 description=f"Service {w.ns_serve}/{serve_svc} to have a ready endpoint")
        url = f"http://{serve_svc}.{w.ns_serve}.svc.cluster.local:{SERVE_PORT}/"
        load_pod = start_load(lab, w.ns_serve, url, timeouts.OPERATOR_UPGRADE.seconds + timeouts.TRAINING_RUN.seconds)
        lab.create_ray(w.ns_train, "rayjobs", training_rayjob(lab, w.ns_train, w.job_name, steps=STEPS,
                                                              step_time_s=STEP_TIME_S))
        log = DriverLog(lab, w.ns_train, w.job_name)
        wait_for(lambda: step_numbers(log, refresh=True), lambda steps: len(steps) >= STEPS_BEFORE,
                 timeout=timeouts.TRAINING_RUN, interval=2,
                 description=f"the training RayJob {w.ns_train}/{w.job_name} to take {STEPS_BEFORE} steps")
        wait_for(lambda: load_seconds(lab, w.ns_serve, load_pod), lambda secs: sum(s["ok"] for s in secs) >= 20,
                 timeout=timeouts.POD_START, interval=2,
                 description=f"the load generator {load_pod} to see 20 answers from {url}")
    return log, load_pod


def record_before(lab: Any, evidence: Any, w: Workloads) -> dict[str, Any]:
    """Record the workloads' Ray objects, pods and uids before the upgrade; what was recorded."""
    before = {"rayservice": ray_object(lab, w.ns_serve, "rayservices", w.service_name),
              "serving_rayclusters": raycluster_uids(lab, w.ns_serve), "serving_pods": lab.pod_restarts(w.ns_serve),
              "rayjob": ray_object(lab, w.ns_train, "rayjobs", w.job_name),
              "pods": lab.pod_restarts(w.ns_train),
              # The training's RayJob and RayClusters, and the RayService, by uid.
              "workload": workload_uids(lab, w.ns_train, w.job_name, w.ns_serve, w.service_name)}
    evidence.record("before", before)
    return before


def upgrade_operator(lab: Any, target: Any, evidence: Any, w: Workloads, version: str, before: dict[str, Any],
                     log: DriverLog) -> UpgradeRun:
    """Upgrade: the target upgrades the KubeRay operator to ``version`` (an UpgradeFailed kept, judged after
    what it did to the workloads); fail unless the workloads' objects were kept and the upgrade completed."""
    with evidence.phase("upgrade"):
        began = time.time()
        steps_at_start = len(step_numbers(log))
        try:
            upgrade = target.upgrade_kuberay(
                version, progress=lambda m: print(f"rayproof: {m}", file=sys.stderr, flush=True))
        except UpgradeFailed as exc:  # judged below, after what it did to the workloads
            upgrade = {"failed": str(exc)}
        evidence.record("upgrade", upgrade)
        kept(before["workload"], evidence.record("workload_after_upgrade", workload_uids(
            lab, w.ns_train, w.job_name, w.ns_serve, w.service_name)), "right after the operator upgrade")
        assert "failed" not in upgrade, f"the KubeRay operator upgrade did not complete: {upgrade.get('failed')}"
        ready_at = upgrade["operator_ready_at"]
    return UpgradeRun(began=began, steps_at_start=steps_at_start, upgrade=upgrade, ready_at=ready_at)


def wait_tail(lab: Any, evidence: Any, w: Workloads, log: DriverLog, load_pod: str, version: str,
              run: UpgradeRun) -> tuple[float, list[dict[str, Any]]]:
    """Tail: the training stepping and the load generator's log running TAIL_S past the new operator's
    readiness; the window's end and the load generator's seconds."""
    with evidence.phase("tail"):
        window_end = run.ready_at + TAIL_S
        wait_for(lambda: step_numbers(log, refresh=True),
                 lambda steps: len(steps) >= run.steps_at_start + STEPS_AFTER
                 and log.events("step")[-1].get("ts", 0) >= window_end,
                 timeout=timeouts.TRAINING_RUN, interval=2,
                 description=f"the training to take {STEPS_AFTER} steps under the KubeRay operator {version}, "
                             f"the last {TAIL_S:g} s after it was ready")
        seconds = wait_for(lambda: load_seconds(lab, w.ns_serve, load_pod),
                           lambda secs: bool(secs) and secs[-1]["window_start"] >= window_end + REQUEST_TIMEOUT_S,
                           timeout=timeouts.CONTAINER_TRANSITION, interval=2,
                           description="the load generator's log to cover the upgrade and its tail")
    return window_end, seconds


def record_after_tail(lab: Any, target: Any, evidence: Any, w: Workloads,
                      before: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Fail unless the workloads' objects were still kept after the tail; record the workloads' Ray objects
    and pods then, and the operator's version; what was recorded of the workloads, and that version."""
    workload_after = evidence.record("workload_after_tail", workload_uids(lab, w.ns_train, w.job_name, w.ns_serve,
                                                                          w.service_name))
    kept(before["workload"], workload_after, f"{TAIL_S:g} s after the operator upgrade")
    after = {"rayservice": ray_object(lab, w.ns_serve, "rayservices", w.service_name),
             "serving_rayclusters": raycluster_uids(lab, w.ns_serve), "serving_pods": lab.pod_restarts(w.ns_serve),
             "serving": service_sample(lab, w.ns_serve, w.service_name),
             "rayjob": ray_object(lab, w.ns_train, "rayjobs", w.job_name),
             "pods": lab.pod_restarts(w.ns_train)}
    evidence.record("after", after)
    operator_after = evidence.record("operator_after", target.describe()["versions"].get("kuberay"))
    return after, operator_after


def record_figures(evidence: Any, log: DriverLog, run: UpgradeRun, seconds: list[dict[str, Any]], window_end: float,
                   before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[dict[str, Any]]]:
    """Record the serving's availability during the upgrade and the upgrade's figures; that availability,
    the training's step numbers and its worker group starts."""
    began, upgrade, ready_at = run.began, run.upgrade, run.ready_at
    window = evidence.record("availability_during_upgrade", load_window(seconds, began, window_end))
    steps = step_numbers(log)
    starts = log.events("worker_group_started")
    evidence.record("figures", {
        "upgrade_s": round(ready_at - began, 1),
        "operator_down_s": round(ready_at - upgrade["operator_stopped_at"], 1) if "operator_stopped_at" in upgrade else None,
        "requests_during_upgrade": window["sent"], "failed_requests": window["failed"],
        "steps_before_upgrade": run.steps_at_start, "steps_total": len(steps), "worker_group_starts": len(starts),
        # Evidence, not judged: a new operator may roll a RayService onto a new
        # cluster (zero-downtime upgrade); the requests above are what count.
        "serving_cluster_replaced": after["serving_rayclusters"] != before["serving_rayclusters"],
    })
    return window, steps, starts


def judge_operator_and_serving(version: str, before_version: Any, operator_after: Any, window: dict[str, Any],
                               began: float, window_end: float) -> None:
    """Fail unless the operator runs ``version`` and the RayService, under the load expected, failed no
    request during the upgrade and its tail."""
    assert operator_after == version, f"after the upgrade the KubeRay operator runs {operator_after}, not {version}"
    assert window["sent"] >= LOAD_RATE * (window_end - began) * 0.5, (
        f"the load generator sent only {window['sent']} requests in the {window_end - began:.0f} s of the upgrade "
        f"(expected about {LOAD_RATE:g}/s): the measurement does not cover it")
    assert window["failed"] == 0, (
        f"the RayService failed {window['failed']} of {window['sent']} requests while the KubeRay operator was "
        f"upgraded {before_version} -> {version} (failing seconds {window['failing_seconds']})")


def judge_training_uninterrupted(before: dict[str, Any], after: dict[str, Any], steps: list[int],
                                 starts: list[dict[str, Any]]) -> None:
    """Fail unless the training's pods were neither restarted nor removed, its worker group started once,
    every step ran once in order, and its RayJob is still running."""
    changed = {n: (p, after["pods"].get(n)) for n, p in before["pods"].items() if n in after["pods"]
               and (p["uid"], p["restarts"]) != (after["pods"][n]["uid"], after["pods"][n]["restarts"])}
    gone = sorted(n for n, p in before["pods"].items() if n not in after["pods"] and p["phase"] == "Running")
    assert not changed and not gone, (
        f"pods of the running training were restarted {changed} or removed {gone} by the operator upgrade")
    assert len(starts) == 1 and steps == list(range(steps[0], steps[0] + len(steps))), (
        f"the training did not go on uninterrupted: its worker group started {len(starts)} times, steps "
        f"{steps[:3]}...{steps[-3:]} ({len(steps)} step events)")
    assert after["rayjob"]["status"].get("jobStatus") == "RUNNING", (
        f"the training RayJob is no longer running under the upgraded operator: {after['rayjob']['status']}")


@pytest.mark.clause("UPG-1")
@pytest.mark.cluster_gangs(2)  # the training's gang and the RayService's cluster
def test_operator_upgrade_keeps_serving_and_training(upgrade_to, lab, target, evidence) -> None:
    """While the platform's KubeRay operator is upgraded to the version
    `certify --upgrade-to` names (its CRDs, then the operator itself), a
    RayService from the golden template under steady load MUST answer every
    request, and a training RayJob MUST go on uninterrupted: the same
    RayCluster and pods, no container restarted, every step run once and the
    training stepping under the new operator; afterwards the operator MUST
    run the new version and take up the next change a team makes to its
    RayService. Not applicable to a certification that upgrades
    nothing. (Where the platform can redeploy the version it runs, an
    "upgrade" to it is judged the same way: its procedure is what is tested.)"""
    version = upgrade_to
    before_version = evidence.record("operator_before", target.describe()["versions"].get("kuberay"))
    # The tenant's first namespace asks for its quota: the training's gang.
    ns_train, ns_serve = lab.namespace("a", gpus=gang_gpus(lab)), lab.namespace("b")
    service_name, job_name = lab.name("upg1-serve"), lab.name("upg1-train")
    w = Workloads(ns_train=ns_train, job_name=job_name, ns_serve=ns_serve, service_name=service_name)
    with evidence.phase("steady state"):
        lab.create_ray(ns_serve, "rayservices", lab.rayservice(ns_serve, service_name, serve_config(1), workers=1))
    with deleted_first(lab, ns_serve, "rayservices", service_name):
        log, load_pod = start_load_and_training(lab, evidence, w)
        before = record_before(lab, evidence, w)
        run = upgrade_operator(lab, target, evidence, w, version, before, log)
        window_end, seconds = wait_tail(lab, evidence, w, log, load_pod, version, run)
        after, operator_after = record_after_tail(lab, target, evidence, w, before)
        with evidence.phase("a change after the upgrade"):
            evidence.record("change_after_upgrade", a_teams_next_change(lab, ns_serve, service_name))

    window, steps, starts = record_figures(evidence, log, run, seconds, window_end, before, after)
    judge_operator_and_serving(version, before_version, operator_after, window, run.began, window_end)
    judge_training_uninterrupted(before, after, steps, starts)
