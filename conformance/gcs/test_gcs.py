"""The Ray head runs out of memory: does GCS fault tolerance keep a RayService
answering through it (GCS-1), and does the damage stay inside the team whose
head it was (GCS-2)."""
from __future__ import annotations

import contextlib
import shlex
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import yaml

from chaos import runner
from conformance.serving import (
    LOAD_RATE,
    REQUEST_TIMEOUT_S,
    SERVE_PORT,
    SERVICE_UP,
    apps_running,
    deleted_first,
    load_seconds,
    load_window,
    per_second,
    serve_config,
    serve_endpoints,
    service_sample,
    start_load,
)
from core import timeouts
from core.figures import AVAILABILITY_BY_PHASE, AVAILABILITY_PER_SECOND, FIGURES, HeadOomFigures
from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for
from fixtures import golden
from fixtures import manifests as mf
from fixtures.events import parse_events
from fixtures.kube import pod_ready

pytestmark = pytest.mark.slow

TAIL_S = 15.0  # the availability window runs this long past the cluster's recovery (head, apps, Ray nodes)
RAY_NODES_URL = "http://{host}:{port}/api/v0/nodes?limit=1000&timeout=3"  # Ray's state API, answered from the GCS
PRESSURE_FACTOR = 4  # the pressure job aims at this multiple of the head's memory limit

# The whole event: the pressure job's submitter starts and its driver fills the
# head, the head is OOM-killed and restarted, Ray comes back and Serve recovers.
EVENT = Tier("gcs_event", timeouts.RAYCLUSTER_READY.seconds + timeouts.SERVE_APP.seconds
             + 2 * timeouts.CONTAINER_TRANSITION.seconds,
             "a head OOM from the pressure job's submission until the cluster and its apps are back")


# -- helpers -------------------------------------------------------------------------


def head_memory_limit(lab, ns: str, cluster: str) -> int:
    """The memory limit of the head container of ``cluster``'s head pod, as
    the cluster created it (its golden template's, or a LimitRange's default);
    a head without one fails the clause: nothing would OOM-kill it alone."""
    from kubernetes.utils import parse_quantity

    pods = [p for p in lab.pods(ns, f"ray.io/cluster={cluster},ray.io/node-type=head")
            if p.metadata.deletion_timestamp is None]
    assert pods, f"RayCluster {ns}/{cluster} has no head pod"
    pod = min(pods, key=lambda p: p.metadata.creation_timestamp)
    limit = ((pod.spec.containers[0].resources.limits or {}) if pod.spec.containers[0].resources else {}).get("memory")
    if limit is None:
        pytest.fail(f"the head container of {ns}/{pod.metadata.name} ({cluster}) has no memory limit, from its golden "
                    "template or a LimitRange of the team's namespace: a head past its memory takes its node's instead "
                    "of being OOM-killed and restarted alone, so a GCS that grows reaches every pod of the node",
                    pytrace=False)
    return int(parse_quantity(limit))


def require_oom_landed(killed: dict[str, Any], ns: str, cluster: str, target_bytes: int, limit_bytes: int) -> None:
    """Fail at once, saying what happened instead, when the fault did not land: a head that never ended
    OOMKilled cannot be judged on its recovery (waiting for one would only time out)."""
    assert killed["reached"], (
        f"the fault did not land: the head of {ns}/{cluster} did not end OOMKilled and restart within "
        f"{killed['elapsed_s']} s of the pressure job ({target_bytes} bytes against a {limit_bytes}-byte limit; "
        f"restarts before {killed['restarts_before']}); head: {killed['head']}; "
        f"pressure job: {killed.get('pressure_job')}")


def head_sample(lab, ns: str, cluster: str) -> dict[str, Any]:
    """The head container of ``cluster``: restarts, last termination, Ready."""
    pods = [p for p in lab.pods(ns, f"ray.io/cluster={cluster},ray.io/node-type=head")
            if p.metadata.deletion_timestamp is None]
    if not pods:
        return {"head_pod": None, "restarts": None, "ready": False}
    pod = min(pods, key=lambda p: p.metadata.creation_timestamp)
    status = next(iter(pod.status.container_statuses or []), None)
    last = status.last_state.terminated if status and status.last_state else None
    return {"head_pod": pod.metadata.name, "head_uid": pod.metadata.uid,
            "restarts": status.restart_count if status else None,
            "last_reason": last.reason if last else None, "last_exit_code": last.exit_code if last else None,
            "last_finished": last.finished_at.timestamp() if last and last.finished_at else None,
            "running": bool(status and status.state and status.state.running), "ready": pod_ready(pod)}


def worker_pods(lab, ns: str, cluster: str) -> dict[str, Any]:
    """The worker pods of RayCluster ``cluster`` by name: uid, container
    restarts and, for a restarted container, how its last instance ended."""
    out = {}
    for pod in lab.pods(ns, f"ray.io/cluster={cluster},ray.io/node-type=worker"):
        ended = []
        for c in pod.status.container_statuses or []:
            last = c.last_state.terminated if c.last_state else None
            if last:
                ended.append(f"{c.name}: {last.reason} (exit {last.exit_code}) at {last.finished_at}")
        out[pod.metadata.name] = {"uid": pod.metadata.uid, "phase": pod.status.phase,
                                  "deleting": pod.metadata.deletion_timestamp is not None,
                                  "restarts": sum(c.restart_count for c in pod.status.container_statuses or []),
                                  "last_terminations": ended}
    return out


def worker_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What happened to the worker pods between ``before`` and ``after``: each
    one restarted, replaced or gone, named with how its container last ended."""
    changes = []
    for name, was in sorted(before.items()):
        now = after.get(name)
        if now is None:
            changes.append(f"worker pod {name} is gone (replaced by {sorted(set(after) - set(before)) or 'nothing'})")
        elif now["uid"] != was["uid"]:
            changes.append(f"worker pod {name} was replaced (uid {was['uid']} -> {now['uid']})")
        elif now["restarts"] != was["restarts"] or now["deleting"]:
            changes.append(f"worker pod {name} restarted ({was['restarts']} -> {now['restarts']} container restarts"
                           f"{', being deleted' if now['deleting'] else ''}); its container last ended: "
                           f"{'; '.join(now['last_terminations']) or 'unknown'}")
    changes += [f"worker pod {name} is new (restarts {now['restarts']})"
                for name, now in sorted(after.items()) if name not in before]
    return changes


def head_service(lab, ns: str, cluster: str) -> str:
    """The name of RayCluster ``cluster``'s head Service (KubeRay's status, or its labels)."""
    named = ((lab.ray(ns, "rayclusters", cluster).get("status") or {}).get("head") or {}).get("serviceName")
    if named:
        return named
    return next(s.metadata.name for s in lab.core.list_namespaced_service(ns).items
                if (s.metadata.labels or {}).get("ray.io/cluster") == cluster
                and (s.metadata.labels or {}).get("ray.io/node-type") == "head")


def start_ray_nodes_observer(lab, ns: str, cluster: str, duration_s: float) -> str:
    """A pod in ``ns`` that logs the alive Ray nodes of ``cluster`` (as its GCS
    reports them through the dashboard's state API) once a second for ``duration_s``."""
    url = RAY_NODES_URL.format(host=f"{head_service(lab, ns, cluster)}.{ns}.svc.cluster.local", port=mf.DASHBOARD_PORT)
    name = lab.name("ray-nodes")
    lab.create_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(lab.labels)},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "observe", "image": lab.profile.ray_image,
            "command": ["python", f"{mf.WORKLOADS_MOUNT}/workloads/ray_nodes_observer.py", url, str(int(duration_s))],
            "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}],
            "volumeMounts": [{"name": "workloads", "mountPath": f"{mf.WORKLOADS_MOUNT}/workloads", "readOnly": True}],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}}],
            "volumes": [{"name": "workloads", "configMap": {"name": mf.WORKLOADS_CONFIGMAP}}]}})
    return name


def ray_nodes_series(lab, ns: str, pod: str) -> list[dict[str, Any]]:
    """The observer's samples so far: ``alive`` (count), ``alive_nodes``, or ``error``."""
    return [e for e in parse_events(lab.core.read_namespaced_pod_log(pod, ns)) if e["event"] == "ray_nodes"]


def nodes_back(series: list[dict[str, Any]], before: dict[str, Any], after: float) -> dict[str, Any] | None:
    """The first sample from ``after`` on in which the GCS lists as many alive
    Ray nodes as ``before``, one of them a head that is not the head of
    ``before``: the restarted head (a new Ray node) has registered, the dead
    one is no longer counted alive, and the workers are all alive."""
    old_heads = {n for n in before["alive_nodes"] if n.startswith("head:")}

    def back(smp: dict[str, Any]) -> bool:
        if smp["ts"] < after or "error" in smp:
            return False
        heads = [n for n in smp["alive_nodes"] if n.startswith("head:")]
        return smp["alive"] == before["alive"] and len(heads) == 1 and heads[0] not in old_heads
    return next((smp for smp in series if back(smp)), None)


def series_summary(series: list[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """``series`` as runs of one value (an alive count, or no answer), seconds from ``since``."""
    runs: list[dict[str, Any]] = []
    for smp in series:
        value = f"alive={smp['alive']}" if "error" not in smp else "no answer"
        at = round(smp["ts"] - since, 1)
        if runs and runs[-1]["value"] == value:
            runs[-1].update(to_s=at, samples=runs[-1]["samples"] + 1)
        else:
            runs.append({"value": value, "from_s": at, "to_s": at, "samples": 1,
                         **({"first_error": smp["error"]} if "error" in smp else {"nodes": smp["alive_nodes"]})})
    return runs


def alive_at(series: list[dict[str, Any]], t: float) -> Any:
    """The observer's last reading at or before ``t`` (an alive count, "no answer", or None)."""
    last = None
    for smp in series:
        if smp["ts"] > t:
            break
        last = smp.get("alive", "no answer") if "error" not in smp else "no answer"
    return last


class Timeline:
    """Samples ``observe()`` about once a second in a thread until the block ends."""

    def __init__(self, observe: Callable[[], dict[str, Any]], description: str):
        self.samples: list[dict[str, Any]] = []
        self.error: str | None = None
        self._observe = observe
        self._description = description
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=description, daemon=True)

    def _sample(self) -> dict[str, Any]:
        value = {"t": round(time.time(), 2), **self._observe()}
        self.samples.append(value)
        return value

    def _run(self) -> None:
        try:
            wait_for(self._sample, lambda _: self._stop.is_set(), timeout=EVENT, interval=1,
                     description=self._description)
        except WaitTimeout as exc:
            self.error = str(exc)

    def __enter__(self) -> "Timeline":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def first(self, predicate: Callable[[dict[str, Any]], bool], after: float = 0.0) -> dict[str, Any] | None:
        return next((s for s in self.samples if s["t"] >= after and predicate(s)), None)


def oom_figures(timeline: Timeline, before: dict[str, Any], submitted_at: float) -> HeadOomFigures:
    """When the head was OOM-killed and Ready again, from the sampled timeline."""
    killed = timeline.first(lambda s: (s.get("restarts") or 0) > before["restarts"]
                            and s.get("last_reason") == "OOMKilled")
    oom_at = (killed or {}).get("last_finished") or (killed or {}).get("t")
    ready = timeline.first(lambda s: (s.get("restarts") or 0) > before["restarts"] and s.get("ready"),
                           after=oom_at or submitted_at) if killed else None
    return {"oom_sample": killed, "oom_at": oom_at, "ready_at": (ready or {}).get("t"),
            "inject_to_oom_s": round(oom_at - submitted_at, 1) if oom_at else None,
            "inject_to_head_ready_s": round(ready["t"] - submitted_at, 1) if ready else None,
            "oom_to_head_ready_s": round(ready["t"] - oom_at, 1) if ready and oom_at else None}


# -- the clauses' steps ----------------------------------------------------------------


@dataclass(frozen=True)
class HeadOom:
    """The injected head OOM: when the pressure job was submitted, and what the OOM probe saw."""

    submitted_at: float
    killed: dict[str, Any]


@dataclass(frozen=True)
class Observers:
    """The pods watching a RayService through the fault, and the alive Ray nodes its GCS listed before it."""

    load_pod: str
    nodes_pod: str
    nodes_before: dict[str, Any]


@dataclass(frozen=True)
class RayServiceRecovery:
    """How a RayService came back from its head's OOM, and where its availability window ends."""

    head_after: dict[str, Any]
    running: dict[str, Any]
    apps_at: float
    back: dict[str, Any] | None
    recovered: dict[str, float]
    window_end: float
    window_reason: str


def deploy_rayservice(lab, evidence, ns: str, name: str, workers: int) -> str | None:
    """Create the platform's golden RayService ``ns``/``name``; record (never set) the GCS fault tolerance
    its template chose and return it (the Redis address, or None)."""
    with evidence.phase("deploy the RayService"):
        service = lab.rayservice(ns, name, serve_config(1), workers=workers)
        # What the golden template decided, read (never set) by the suite.
        ft = evidence.record("gcs_fault_tolerance", golden.gcs_redis_address(service))
        evidence.record("exclude_head_from_serve_service", bool(service["spec"].get("excludeHeadPodFromServeSvc")))
        lab.create_ray(ns, "rayservices", service)
    return ft


def wait_rayservice_serving(lab, evidence, ns: str, name: str, ft: str | None) -> tuple[str, str]:
    """Wait for the RayService's apps RUNNING and its Serve Service to have a ready endpoint; its RayCluster
    and Serve Service."""
    with evidence.phase("deploy the RayService"):
        up = wait_for(lambda: service_sample(lab, ns, name), lambda s: s["cluster"] and apps_running(s),
                      timeout=SERVICE_UP, interval=2, description=f"RayService {ns}/{name} apps RUNNING")
        cluster = up["cluster"]
        serve_svc = f"{name}-serve-svc"
        wait_for(lambda: serve_endpoints(lab, ns, serve_svc), timeout=timeouts.SERVE_APP,
                 description=f"Service {ns}/{serve_svc} to have a ready endpoint")
        evidence.record("rayservice", {"name": name, "cluster": cluster, "gcs": ft})
    return cluster, serve_svc


def start_observers(lab, evidence, ns: str, cluster: str, serve_svc: str, workers: int) -> Observers:
    """Start the load generator on the Serve Service and the Ray-nodes observer; wait for a baseline of
    answers and for the GCS to list the head and every worker alive."""
    with evidence.phase("baseline load and Ray nodes"):
        url = f"http://{serve_svc}.{ns}.svc.cluster.local:{SERVE_PORT}/"
        observe_s = EVENT.seconds + timeouts.RAYCLUSTER_READY.seconds
        load_pod = start_load(lab, ns, url, observe_s)
        nodes_pod = start_ray_nodes_observer(lab, ns, cluster, observe_s)
        baseline = wait_for(lambda: load_seconds(lab, ns, load_pod), lambda secs: sum(s["ok"] for s in secs) >= 20,
                            timeout=timeouts.POD_START, interval=2,
                            description=f"the load generator {load_pod} to see 20 answers from {url}")
        evidence.record("baseline", load_window(baseline, 0, float("inf")))
        # The steady state: the GCS lists the head and every worker alive.
        nodes_before = wait_for(lambda: ray_nodes_series(lab, ns, nodes_pod),
                                lambda series: bool(series) and series[-1].get("alive") == 1 + workers,
                                timeout=timeouts.RAY_NODE, interval=2,
                                description=f"the GCS of {ns}/{cluster} to list {1 + workers} alive Ray nodes "
                                            f"(observer pod {nodes_pod})")[-1]
    return Observers(load_pod, nodes_pod, nodes_before)


def record_rayservice_before(lab, evidence, ns: str, cluster: str,
                             nodes_before: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Record the head, the worker pods and the alive Ray nodes before the fault; the head and the worker pods."""
    before = head_sample(lab, ns, cluster)
    workers_before = worker_pods(lab, ns, cluster)
    evidence.record("head_before", before)
    evidence.record("worker_pods_before", workers_before)
    evidence.record("ray_nodes_before", nodes_before)
    return before, workers_before


def inject_rayservice_head_oom(lab, evidence, tmp_path, ns: str, cluster: str, pressure: str, before: dict[str, Any],
                               limit_bytes: int, target_bytes: int) -> HeadOom:
    """Push the RayService's head past its memory limit with the pressure job ``pressure``; record the OOM
    probe and fail at once when the head did not end OOMKilled."""
    with evidence.phase("inject and observe"):
        journal = runner.run("head-oom", {
            "kubeconfig": str(lab.kubeconfig), "context": lab.context, "namespace": ns, "cluster": cluster,
            "target_bytes": target_bytes, "pressure_job": pressure, "labels": lab.labels,
            "within_s": timeouts.RAYCLUSTER_READY.seconds, "head_restarts_before": before["restarts"]},
            journal_path=tmp_path / "journal.json")
        evidence.attach_file("chaostoolkit journal", tmp_path / "journal.json")
        evidence.record("experiment", runner.summary(journal))
        injected = runner.output(journal, "submit-head-pressure")
        killed = runner.output(journal, "head-oom-killed")
        submitted_at = injected["submitted_at"]
    evidence.record("oom_probe", killed)
    require_oom_landed(killed, ns, cluster, target_bytes, limit_bytes)
    return HeadOom(submitted_at, killed)


def await_rayservice_recovery(lab, evidence, ns: str, name: str, cluster: str, timeline: Timeline,
                              before: dict[str, Any], obs: Observers, submitted_at: float) -> RayServiceRecovery:
    """Wait for the head Ready, the apps RUNNING and the GCS listing as many alive Ray nodes as before (the
    restarted head among them); the availability window ends TAIL_S after the last of these (or after the
    wait for the Ray nodes gave up)."""
    nodes_pod, nodes_before = obs.nodes_pod, obs.nodes_before
    with evidence.phase("recovery: head Ready, apps RUNNING"):
        head_after = wait_for(lambda: head_sample(lab, ns, cluster),
                              lambda h: h["ready"] and (h["restarts"] or 0) > before["restarts"],
                              timeout=timeouts.HEAD_RECOVERY, interval=1,
                              description=f"the head of {ns}/{cluster} Ready again after its OOM kill")
        ready_at = oom_figures(timeline, before, submitted_at)["ready_at"] or time.time()
        running = wait_for(lambda: service_sample(lab, ns, name), apps_running, timeout=timeouts.SERVE_APP,
                           interval=1, description=f"RayService {ns}/{name} apps RUNNING after the head OOM")
        apps_at = (timeline.first(apps_running, after=ready_at) or {}).get("t") or time.time()
    with evidence.phase("recovery: Ray nodes back"):
        nodes_description = (f"the GCS of {ns}/{cluster} to list {nodes_before['alive']} alive Ray nodes "
                             f"again, the restarted head (a new Ray node) among them")
        try:
            series = wait_for(lambda: ray_nodes_series(lab, ns, nodes_pod),
                              lambda series: nodes_back(series, nodes_before, submitted_at) is not None,
                              timeout=timeouts.RAY_NODE, interval=2, description=nodes_description)
            back = nodes_back(series, nodes_before, submitted_at)
        except WaitTimeout as exc:  # judged below; the window ends where the wait gave up
            series, back = exc.last_value or [], None
        recovered = {"head Ready": ready_at, "Serve applications RUNNING": apps_at,
                     f"{nodes_before['alive']} alive Ray nodes": back["ts"] if back else time.time()}
        last_step = max(recovered, key=recovered.get)
        window_end = recovered[last_step] + TAIL_S
        window_reason = (f"{TAIL_S:g} s after the last recovery step ({last_step}, "
                         f"{recovered[last_step] - submitted_at:.1f} s after the pressure job's submission)"
                         if back else f"{TAIL_S:g} s after the wait for {nodes_description} gave up "
                         f"(timeout {timeouts.RAY_NODE.name}={timeouts.RAY_NODE.seconds:g} s)")
    return RayServiceRecovery(head_after, running, apps_at, back, recovered, window_end, window_reason)


def wait_availability_tail(lab, evidence, ns: str, cluster: str, obs: Observers,
                           window_end: float) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """Wait out the tail past ``window_end``; the load generator's seconds (covering the window), the worker
    pods and the alive Ray nodes the GCS listed."""
    load_pod, nodes_pod = obs.load_pod, obs.nodes_pod
    with evidence.phase("availability tail"):
        wait_for(lambda: time.time(), lambda now: now >= window_end + REQUEST_TIMEOUT_S + 2,
                 timeout=timeouts.CONTAINER_TRANSITION, interval=1, description="the availability tail to pass")
        seconds = wait_for(lambda: load_seconds(lab, ns, load_pod),
                           lambda secs: bool(secs) and secs[-1]["window_start"] >= window_end,
                           timeout=timeouts.CONTAINER_TRANSITION, interval=2,
                           description="the load generator's log to cover the event window")
        workers_after = worker_pods(lab, ns, cluster)
        series = ray_nodes_series(lab, ns, nodes_pod)
    return seconds, workers_after, series


def record_recovery_figures(evidence, timeline: Timeline, before: dict[str, Any], submitted_at: float,
                            rec: RayServiceRecovery) -> HeadOomFigures:
    """Record the head after recovery, the OOM's figures and the app states and RayClusters seen; the figures."""
    apps_at, back = rec.apps_at, rec.back
    figures = oom_figures(timeline, before, submitted_at)
    figures["apps_running_at"] = apps_at
    figures["inject_to_apps_running_s"] = round(apps_at - submitted_at, 1)
    figures["nodes_back_at"] = back["ts"] if back else None
    figures["inject_to_nodes_back_s"] = round(back["ts"] - submitted_at, 1) if back else None
    evidence.record("head_after", rec.head_after)
    evidence.record(FIGURES, {k: v for k, v in figures.items() if k != "oom_sample"})
    seen_apps = sorted({f"{a}={s}" for smp in timeline.samples for a, s in smp["apps"].items()})
    clusters_seen = sorted({smp["cluster"] for smp in timeline.samples if smp.get("cluster")}
                           | {smp["pending_cluster"] for smp in timeline.samples if smp.get("pending_cluster")})
    evidence.record("app_states_seen", seen_apps)
    evidence.record("ray_clusters_seen", clusters_seen)
    evidence.record("apps_after", rec.running["apps"])
    return figures


def record_ray_nodes(evidence, series: list[dict[str, Any]], nodes_before: dict[str, Any], workers: int,
                     back: dict[str, Any] | None, submitted_at: float) -> list[dict[str, Any]]:
    """Record the alive Ray nodes through the event; the observer's samples since the submission."""
    during = [smp for smp in series if smp["ts"] >= submitted_at]
    ray_workers = [sorted(n for n in smp["alive_nodes"] if n.startswith("worker:")) for smp in (nodes_before, back)
                   if smp]
    evidence.record("ray_nodes", {
        "before": nodes_before["alive"], "expected": 1 + workers, "back": back,
        "min_alive_during_event": min((smp["alive"] for smp in during if "error" not in smp), default=None),
        "seconds_without_answer": sum("error" in smp for smp in during),
        # The same worker Ray nodes (ids) before and after: the workers' raylets survived the head restart.
        "same_worker_ray_nodes": ray_workers[0] == ray_workers[1] if back else None,
        "series_since_submission": series_summary(during, submitted_at)})
    return during


def record_availability(evidence, seconds: list[dict[str, Any]], figures: dict[str, Any], rec: RayServiceRecovery,
                        submitted_at: float) -> dict[str, Any]:
    """Record the availability window (its end and why), per second and by phase of the event; the window."""
    window_end, recovered = rec.window_end, rec.recovered
    evidence.record("availability_window_end", {"at": window_end, "reason": rec.window_reason,
                                                "recovery_steps_s": {k: round(v - submitted_at, 1)
                                                                     for k, v in recovered.items()}})
    window = load_window(seconds, submitted_at, window_end)
    evidence.record("availability_window", {"start": submitted_at, "end": window_end, **window})
    evidence.record(AVAILABILITY_PER_SECOND, per_second(seconds, submitted_at, window_end))
    oom_at = figures["oom_at"] or submitted_at
    recovered_at = window_end - TAIL_S
    evidence.record(AVAILABILITY_BY_PHASE, {
        "inject_to_oom": load_window(seconds, submitted_at, oom_at),
        "oom_to_head_ready": load_window(seconds, oom_at, figures["ready_at"] or recovered_at),
        "head_ready_to_recovered": load_window(seconds, figures["ready_at"] or recovered_at, recovered_at),
        "tail": load_window(seconds, recovered_at, window_end)})
    return window


def record_restarts_after(evidence, timeline: Timeline, seconds: list[dict[str, Any]], before: dict[str, Any],
                          rec: RayServiceRecovery, submitted_at: float, workers_after: dict[str, Any]) -> None:
    """Record the head's restarts and terminations, the worker pods after, and the load until the apps RUNNING."""
    head_after = rec.head_after
    evidence.record("head_restarts_after_oom", {"before": before["restarts"], "after": head_after["restarts"],
                                                "restarts": head_after["restarts"] - before["restarts"],
                                                "terminations_seen": sorted({
                                                    f"{s['restarts']}:{s['last_reason']}({s['last_exit_code']})"
                                                    for s in timeline.samples if s.get("last_reason")})})
    evidence.record("worker_pods_after", workers_after)
    evidence.record("load_until_apps_running", load_window(seconds, submitted_at, rec.apps_at))


def attach_rayservice_timelines(evidence, tmp_path, timeline: Timeline, series: list[dict[str, Any]]) -> None:
    """Attach the sampled timeline (with the alive Ray nodes at each sample) and the Ray-nodes series."""
    for smp in timeline.samples:
        smp["ray_nodes_alive"] = alive_at(series, smp["t"])
    timeline_file = tmp_path / "timeline.yaml"
    timeline_file.write_text(yaml.safe_dump(timeline.samples, sort_keys=False))
    evidence.attach_file("head and RayService timeline", timeline_file)
    nodes_file = tmp_path / "ray_nodes.yaml"
    nodes_file.write_text(yaml.safe_dump(series, sort_keys=False))
    evidence.attach_file("alive Ray nodes as the GCS listed them", nodes_file)


def judge_rayservice_through_oom(ns: str, cluster: str, target: float, ft: str | None, before: dict[str, Any],
                                 oom: HeadOom, rec: RayServiceRecovery, window: dict[str, Any],
                                 nodes_before: dict[str, Any], during: list[dict[str, Any]],
                                 workers_before: dict[str, Any], workers_after: dict[str, Any]) -> None:
    """GCS-1's verdict: the head OOM-killed and its container restarted, the RayService available through
    the window, the Ray nodes back, and the worker pods untouched."""
    head_after, back, window_end, window_reason = rec.head_after, rec.back, rec.window_end, rec.window_reason
    submitted_at = oom.submitted_at
    oomed = oom.killed["head"]
    assert (oomed["restarts"] or 0) > before["restarts"] and head_after["restarts"] > before["restarts"], (
        f"the head container's restart count did not rise after the pressure job (before {before['restarts']}, "
        f"at the OOM probe {oomed['restarts']}, after recovery {head_after['restarts']})")
    assert oomed["last_reason"] == "OOMKilled" and oomed["last_exit_code"] == 137, (
        f"the head's termination after the pressure job was expected OOMKilled (137), was {oomed['last_reason']} "
        f"({oomed['last_exit_code']})")
    assert head_after["head_uid"] == before["head_uid"], (
        f"the head pod was replaced ({before['head_pod']} -> {head_after['head_pod']}) instead of its container "
        f"being restarted")
    assert window["sent"] >= LOAD_RATE * (window_end - submitted_at) * 0.5, (
        f"the load generator sent only {window['sent']} requests in the {window_end - submitted_at:.0f} s window "
        f"(expected about {LOAD_RATE:g}/s): the measurement does not cover the event")
    assert window["availability"] >= target, (
        f"the RayService answered {window['ok']} of {window['sent']} requests ({window['availability']:.2%}) from the "
        f"pressure job's submission until {window_reason}, below the target {target:.2%} (GCS fault tolerance "
        f"{'on, Redis at ' + ft if ft else 'off in the golden RayService template'}); "
        f"failing seconds {window['failing_seconds']}")
    assert back, (
        f"the GCS of {ns}/{cluster} did not list {nodes_before['alive']} alive Ray nodes (the restarted head among "
        f"them) within {timeouts.RAY_NODE.seconds:g} s of the Serve applications RUNNING again: the cluster is not "
        f"back as Ray sees it; since the OOM it listed {series_summary(during, submitted_at)[-6:]}")
    changed = worker_changes(workers_before, workers_after)
    assert not changed, (
        f"the head's OOM restart reached the workers of {ns}/{cluster}, which GCS fault tolerance promises survive "
        f"a head restart (GCS fault tolerance {'on' if ft else 'off in the golden RayService template'}): " + "; ".join(changed))


# -- clauses ---------------------------------------------------------------------------


@pytest.mark.clause("GCS-1")
def test_head_oom_keeps_rayservice_available(lab, evidence, tmp_path) -> None:
    """When the Ray head of a RayService is pushed past its memory limit (a
    head-pressure RayJob submitted to the running cluster), the head container
    MUST end OOMKilled and be restarted (its restart count rises), the
    RayService MUST keep answering with availability at least the profile's
    serving target from the pressure job's submission until the cluster is
    back as Ray sees it -- the head Ready again, its Serve applications
    RUNNING and the GCS listing as many alive Ray nodes as before the fault
    (plus a short tail) -- and the worker pods MUST come through it neither
    restarted nor replaced. The RayService is the platform's golden one: its
    GCS fault tolerance (a Redis the template names) is the platform's choice."""
    target = float(lab.profile["serving"]["availabilityTarget"])
    evidence.record("availability_target", target)
    ns = lab.namespace("a")
    name = lab.name("gcs1")
    workers = 1
    ft = deploy_rayservice(lab, evidence, ns, name, workers)
    with deleted_first(lab, ns, "rayservices", name):
        cluster, serve_svc = wait_rayservice_serving(lab, evidence, ns, name, ft)
        obs = start_observers(lab, evidence, ns, cluster, serve_svc, workers)
        before, workers_before = record_rayservice_before(lab, evidence, ns, cluster, obs.nodes_before)
        limit_bytes = head_memory_limit(lab, ns, cluster)
        target_bytes = PRESSURE_FACTOR * limit_bytes
        pressure = lab.name("head-pressure")
        with Timeline(lambda: {**head_sample(lab, ns, cluster), **service_sample(lab, ns, name)},
                      f"sampling RayService {ns}/{name} through the head OOM") as timeline:
            oom = inject_rayservice_head_oom(lab, evidence, tmp_path, ns, cluster, pressure, before, limit_bytes,
                                             target_bytes)
            rec = await_rayservice_recovery(lab, evidence, ns, name, cluster, timeline, before, obs, oom.submitted_at)
            seconds, workers_after, series = wait_availability_tail(lab, evidence, ns, cluster, obs, rec.window_end)
        figures = record_recovery_figures(evidence, timeline, before, oom.submitted_at, rec)
        during = record_ray_nodes(evidence, series, obs.nodes_before, workers, rec.back, oom.submitted_at)
        window = record_availability(evidence, seconds, figures, rec, oom.submitted_at)
        record_restarts_after(evidence, timeline, seconds, before, rec, oom.submitted_at, workers_after)
        attach_rayservice_timelines(evidence, tmp_path, timeline, series)

    judge_rayservice_through_oom(ns, cluster, target, ft, before, oom, rec, window, obs.nodes_before, during,
                                 workers_before, workers_after)


TICK_GAP_S = 15.0  # the most another team's job may go without progress during the event


def tick_entrypoint(ticks: int) -> str:
    """A driver that runs one small task on a worker per second and prints a
    ``tick`` event after each, for ``ticks`` seconds: progress anyone can read."""
    code = ("import json, time, ray\n"
            "ray.init()\n"
            "@ray.remote(num_cpus=0.25)\n"
            "def tick(i):\n"
            "    return i\n"
            f"for i in range({int(ticks)}):\n"
            "    ray.get(tick.remote(i))\n"
            "    print('RAYPROOF_EVENT ' + json.dumps({'event': 'tick', 'i': i, 'ts': round(time.time(), 3)}), flush=True)\n"
            "    time.sleep(1)  # sleep-ok: the job's own pace\n")
    return f"python -c {shlex.quote(code)}"


def ticks_of(lab, ns: str, rayjob: str) -> list[dict[str, Any]]:
    return [e for e in parse_events(lab.submitter_logs(ns, rayjob)) if e["event"] == "tick"]


def progress(ticks: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Ticks in [start, end) and the longest stretch of [start, end) without one."""
    times = sorted(t["ts"] for t in ticks)
    inside = [t for t in times if start <= t < end]
    marks = [start, *inside, end]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    return {"ticks_in_window": len(inside), "longest_gap_s": round(max(gaps), 1),
            "ticks_before": sum(t < start for t in times), "ticks_after": sum(t >= end for t in times),
            "last_tick": times[-1] if times else None}


def ray_cluster_of(lab, ns: str, rayjob: str) -> dict[str, Any]:
    """The RayCluster a RayJob runs on (its status) and the pods and IPs of that cluster's head."""
    cluster = lab.rayjob_status(ns, rayjob).get("rayClusterName")
    heads = lab.pods(ns, f"ray.io/cluster={cluster},ray.io/node-type=head") if cluster else []
    return {"namespace": ns, "rayjob": rayjob, "ray_cluster": cluster, "head_pods": [p.metadata.name for p in heads],
            "head_ips": [p.status.pod_ip for p in heads if p.status.pod_ip]}


def rayjob_sample(lab, ns: str, name: str) -> dict[str, Any]:
    st = lab.rayjob_status(ns, name)
    return {k: st.get(k) for k in ("jobStatus", "jobDeploymentStatus", "reason", "failed", "succeeded", "jobId")} | {
        "message": (st.get("message") or "")[:300]}


TERMINAL_JOB = ("SUCCEEDED", "FAILED", "STOPPED")
TERMINAL_DEPLOYMENT = ("Complete", "Failed", "Retrying")


def settled(job: dict[str, Any]) -> bool:
    """Terminal, or visibly retrying (KubeRay's Retrying or a counted failed attempt)."""
    return (job.get("jobStatus") in TERMINAL_JOB or job.get("jobDeploymentStatus") in TERMINAL_DEPLOYMENT
            or bool(job.get("failed")))


def deploy_both_teams(lab, evidence, ns_a: str, ns_b: str, cluster_a: str, other: str, ticks_long: int) -> None:
    """Create team A's RayCluster and team B's ticking RayJob (the platform's golden templates)."""
    with evidence.phase("deploy both teams"):
        lab.create_ray(ns_a, "rayclusters", lab.raycluster(ns_a, cluster_a, workers=1))
        lab.create_ray(ns_b, "rayjobs", lab.rayjob(ns_b, other, tick_entrypoint(ticks_long), workers=1))


def start_victim_and_check_tenancy(lab, evidence, ns_a: str, ns_b: str, cluster_a: str, victim: str, other: str,
                                   ticks_long: int) -> None:
    """Once team A's head is Ready, run team A's ticking RayJob ``victim`` on it; wait for both teams' jobs to
    make progress, record which RayCluster each runs on, and require team B's on a Ray head of its own."""
    with evidence.phase("deploy both teams"):
        wait_for(lambda: head_sample(lab, ns_a, cluster_a), lambda h: h["ready"], timeout=timeouts.RAYCLUSTER_READY,
                 interval=2, description=f"the head of RayCluster {ns_a}/{cluster_a} to be Ready")
        lab.create_ray(ns_a, "rayjobs", lab.rayjob_on_cluster(ns_a, victim, tick_entrypoint(ticks_long),
                                                              cluster=cluster_a))
        wait_for(lambda: ticks_of(lab, ns_a, victim), lambda t: len(t) >= 3, timeout=timeouts.RAYCLUSTER_READY,
                 interval=2, description=f"team A's RayJob {ns_a}/{victim} to make progress")
        wait_for(lambda: ticks_of(lab, ns_b, other), lambda t: len(t) >= 3, timeout=timeouts.RAYCLUSTER_READY,
                 interval=2, description=f"team B's RayJob {ns_b}/{other} to make progress")
        # Which RayCluster and GCS each team's job really runs on (measured, not declared).
        tenancy = evidence.record("tenancy", {"team_a": ray_cluster_of(lab, ns_a, victim),
                                              "team_b": ray_cluster_of(lab, ns_b, other)})
        a_heads, b_heads = (set(tenancy[t]["head_ips"]) for t in ("team_a", "team_b"))
        assert b_heads and not a_heads & b_heads, (
            f"team B's job does not run on a Ray head of its own, apart from team A's: {tenancy}")


def record_teams_before(lab, evidence, ns_a: str, cluster_a: str,
                        ns_b: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Record team B's pods and team A's head before the fault; both."""
    b_before = lab.pod_restarts(ns_b)
    before = head_sample(lab, ns_a, cluster_a)
    evidence.record("team_b_pods_before", b_before)
    evidence.record("head_before", before)
    return b_before, before


def inject_team_a_head_oom(lab, evidence, tmp_path, ns_a: str, cluster_a: str, before: dict[str, Any],
                           limit_bytes: int, target_bytes: int) -> HeadOom:
    """Push team A's head past its memory limit with a pressure job; record the OOM probe and fail at once
    when the head did not end OOMKilled."""
    with evidence.phase("inject and observe"):
        journal = runner.run("head-oom", {
            "kubeconfig": str(lab.kubeconfig), "context": lab.context, "namespace": ns_a, "cluster": cluster_a,
            "target_bytes": target_bytes, "pressure_job": lab.name("head-pressure"), "labels": lab.labels,
            "within_s": timeouts.RAYCLUSTER_READY.seconds, "head_restarts_before": before["restarts"]},
            journal_path=tmp_path / "journal.json")
        evidence.attach_file("chaostoolkit journal", tmp_path / "journal.json")
        evidence.record("experiment", runner.summary(journal))
        submitted_at = runner.output(journal, "submit-head-pressure")["submitted_at"]
        killed = runner.output(journal, "head-oom-killed")
    evidence.record("oom_probe", killed)
    require_oom_landed(killed, ns_a, cluster_a, target_bytes, limit_bytes)
    return HeadOom(submitted_at, killed)


def await_recovery_and_team_b_ticks(lab, evidence, ns_a: str, cluster_a: str, victim: str, ns_b: str, other: str,
                                    timeline: Timeline, before: dict[str, Any],
                                    submitted_at: float) -> tuple[dict[str, Any], float, list[dict[str, Any]]]:
    """Wait for team A's head Ready again and its RayJob to settle, then for team B's job to tick past the event
    window (TAIL_S past the head Ready); the head after, the window's end and team B's ticks seen."""
    with evidence.phase("recovery"):
        head_after = wait_for(lambda: head_sample(lab, ns_a, cluster_a),
                              lambda h: h["ready"] and (h["restarts"] or 0) > before["restarts"],
                              timeout=timeouts.HEAD_RECOVERY, interval=1,
                              description=f"the head of {ns_a}/{cluster_a} Ready again after its OOM kill")
        window_end = (oom_figures(timeline, before, submitted_at)["ready_at"] or time.time()) + TAIL_S
        with contextlib.suppress(WaitTimeout):  # judged below from what was seen
            wait_for(lambda: rayjob_sample(lab, ns_a, victim), settled, timeout=timeouts.HEAD_LOSS_SETTLE,
                     interval=2, description=f"team A's RayJob {ns_a}/{victim} to settle after the head OOM")
        try:
            b_ticks = wait_for(lambda: ticks_of(lab, ns_b, other),
                               lambda t: bool(t) and t[-1]["ts"] >= window_end,
                               timeout=timeouts.CONTAINER_TRANSITION, interval=2,
                               description=f"team B's job {ns_b}/{other} to tick past the event window")
        except WaitTimeout as exc:  # its progress stopped: judged below from the ticks seen
            b_ticks = exc.last_value or []
    return head_after, window_end, b_ticks


@dataclass(frozen=True)
class TeamsAfter:
    """Both teams after the event: team A's RayJob (and whether its entrypoint ran again from the start),
    team B's pods and its job's progress through the window."""

    victim_after: dict[str, Any]
    rerun: list[dict[str, Any]]
    rerun_after_s: float | None
    b_after: dict[str, Any]
    b_progress: dict[str, Any]


def record_teams_after(lab, evidence, tmp_path, ns_a: str, victim: str, ns_b: str, timeline: Timeline,
                       before: dict[str, Any], submitted_at: float, window_end: float, head_after: dict[str, Any],
                       b_ticks: list[dict[str, Any]]) -> TeamsAfter:
    """Read and record both teams after the event (team A's RayJob and pods, team B's pods and progress, the
    OOM's figures and the job states seen) and attach the sampled timeline."""
    victim_after = rayjob_sample(lab, ns_a, victim)
    # A RayJob that shows Running may be running its entrypoint again from
    # the start (a new submitter on a head that forgot the job).
    rerun = [t for t in ticks_of(lab, ns_a, victim) if t["i"] == 0 and t["ts"] >= submitted_at]
    rerun_after_s = evidence.record("victim_rerun_from_start_after_s",
                                    round(rerun[0]["ts"] - submitted_at, 1) if rerun else None)
    b_after = lab.pod_restarts(ns_b)
    figures = oom_figures(timeline, before, submitted_at)
    settled_at = timeline.first(lambda s: settled(s["victim"]), after=submitted_at)
    figures["inject_to_victim_settled_s"] = round(settled_at["t"] - submitted_at, 1) if settled_at else None
    b_progress = progress(b_ticks, submitted_at, window_end)
    evidence.record("head_after", head_after)
    evidence.record(FIGURES, {k: v for k, v in figures.items() if k != "oom_sample"})
    evidence.record("victim_rayjob", victim_after)
    evidence.record("victim_states_seen", sorted({f"{s['victim'].get('jobStatus')}/"
                                                  f"{s['victim'].get('jobDeploymentStatus')}"
                                                  for s in timeline.samples if "victim" in s}))
    evidence.record("team_b_states_seen", sorted({f"{s['team_b'].get('jobStatus')}/"
                                                  f"{s['team_b'].get('jobDeploymentStatus')}"
                                                  for s in timeline.samples if "team_b" in s}))
    evidence.record("team_b_pods_after", b_after)
    evidence.record("team_b_progress", {"start": submitted_at, "end": window_end, **b_progress})
    evidence.record("team_a_pods_after", lab.pod_restarts(ns_a))
    timeline_file = tmp_path / "timeline.yaml"
    timeline_file.write_text(yaml.safe_dump(timeline.samples, sort_keys=False))
    evidence.attach_file("head and RayJob timeline", timeline_file)
    return TeamsAfter(victim_after, rerun, rerun_after_s, b_after, b_progress)


def judge_head_oom_isolation(lab, ns_a: str, cluster_a: str, victim: str, ns_b: str, other: str,
                             killed: dict[str, Any], b_before: dict[str, Any], after: TeamsAfter) -> None:
    """GCS-2's verdict: team A's head OOM-killed, team B's pods untouched and its job progressing and still
    running, and team A's RayJob terminal or retrying."""
    b_after, b_progress, victim_after = after.b_after, after.b_progress, after.victim_after
    rerun, rerun_after_s = after.rerun, after.rerun_after_s
    assert killed["reached"] and killed["head"]["last_reason"] == "OOMKilled", (
        f"the head of team A's {ns_a}/{cluster_a} was expected OOMKilled after the pressure job; probe: {killed}")
    changed = {n: (b_before.get(n), b_after.get(n)) for n in set(b_before) | set(b_after)
               if b_before.get(n) is None or b_after.get(n) is None
               or (b_before[n]["uid"], b_before[n]["restarts"]) != (b_after[n]["uid"], b_after[n]["restarts"])}
    assert not changed, f"team B's pods in {ns_b} were restarted, replaced or removed by team A's head OOM: {changed}"
    assert b_progress["ticks_after"] and b_progress["longest_gap_s"] <= TICK_GAP_S, (
        f"team B's job {ns_b}/{other} went {b_progress['longest_gap_s']} s without progress during team A's head OOM "
        f"(at most {TICK_GAP_S:g} s expected; {b_progress['ticks_in_window']} ticks in the window, "
        f"{b_progress['ticks_after']} after)")
    b_status = rayjob_sample(lab, ns_b, other)
    assert b_status.get("jobStatus") == "RUNNING", f"team B's RayJob {ns_b}/{other} is no longer running: {b_status}"
    assert settled(victim_after), (
        f"team A's RayJob {ns_a}/{victim}, whose driver ran on the OOM-killed head, still shows {victim_after} "
        f"{timeouts.HEAD_LOSS_SETTLE.seconds:g} s after the head was Ready again: neither terminal nor retrying"
        + (f"; its entrypoint started again from the beginning {rerun_after_s:g} s after the pressure was "
           "submitted, which the RayJob's status does not show" if rerun else ""))


@pytest.mark.clause("GCS-2")
@pytest.mark.cluster_gangs(2)  # two teams' Ray clusters at once
def test_head_oom_stays_in_its_namespace(lab, evidence, tmp_path) -> None:
    """A head OOM on team A's RayCluster MUST stay inside team A: another
    team's job, from the platform's golden RayJob in namespace B (another
    tenant of the platform, with its own ClusterQueue), runs on a
    Ray head of its own (measured from the RayJobs' clusters and their head
    pods, never read from the profile); team B's RayCluster sees no pod
    restarted or replaced and its job keeps making progress through the event
    (no stretch without progress longer than 15 s), and team A's RayJob that
    was running on the hit head (the golden RayJob sent to team A's cluster,
    with the platform's submitter) MUST reach a terminal or retrying state
    instead of showing Running forever."""
    ns_a, ns_b = lab.namespace("a"), lab.namespace("b", own_tenant=True)  # another tenant: its own ClusterQueue
    cluster_a = lab.name("team-a")
    victim = lab.name("victim")
    other = lab.name("team-b")
    ticks_long = int(EVENT.seconds + SERVICE_UP.seconds)
    deploy_both_teams(lab, evidence, ns_a, ns_b, cluster_a, other, ticks_long)
    with deleted_first(lab, ns_a, "rayclusters", cluster_a):
        start_victim_and_check_tenancy(lab, evidence, ns_a, ns_b, cluster_a, victim, other, ticks_long)
        b_before, before = record_teams_before(lab, evidence, ns_a, cluster_a, ns_b)
        limit_bytes = head_memory_limit(lab, ns_a, cluster_a)
        target_bytes = PRESSURE_FACTOR * limit_bytes
        with Timeline(lambda: {**head_sample(lab, ns_a, cluster_a), "victim": rayjob_sample(lab, ns_a, victim),
                               "team_b": rayjob_sample(lab, ns_b, other)},
                      "sampling team A's head and jobs of both teams through the head OOM") as timeline:
            oom = inject_team_a_head_oom(lab, evidence, tmp_path, ns_a, cluster_a, before, limit_bytes, target_bytes)
            head_after, window_end, b_ticks = await_recovery_and_team_b_ticks(
                lab, evidence, ns_a, cluster_a, victim, ns_b, other, timeline, before, oom.submitted_at)
        after = record_teams_after(lab, evidence, tmp_path, ns_a, victim, ns_b, timeline, before, oom.submitted_at,
                                   window_end, head_after, b_ticks)

    judge_head_oom_isolation(lab, ns_a, cluster_a, victim, ns_b, other, oom.killed, b_before, after)
