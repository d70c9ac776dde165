"""What Kueue and KubeRay hold at one moment, for the admission clauses.

A sample reads, in this order, the Kueue Workloads, the RayJobs, the pods and
the ClusterQueue, so a job seen holding pods was already seen admitted or
not (admission precedes pod creation; release follows pod deletion). Each
RayJob's gang is its RayCluster's pods (head and workers, told apart by the
``ray.io/cluster`` label, which KubeRay names ``<rayjob>-<suffix>``); the
submitter pod (label ``job-name``) is counted apart. Samples are plain dicts,
so the clauses put them into their evidence as they are.

Only what holds resources is judged. A pod that has ended (Succeeded,
Failed), is being deleted, or whose controlling RayCluster or submitter Job
is gone or being deleted is being given back: when Kueue evicts or a job
finishes, KubeRay deletes the RayCluster and the submitter Job, Kueue
releases the quota, and the garbage collector reaches the pods a moment
later. Such pods are counted as ``releasing``, never as held without quota
(ADM-2 once failed on a loaded machine on exactly that moment). The owners
are read after the pods, so an owner deleted between the two reads makes
its pods look released, never held.
"""
from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any, Iterable

from chaos.rayjob import reason_matches
from core import kueue
from fixtures import manifests as mf
from fixtures.kube import condition

GPU = "nvidia.com/gpu"
FINISHED = ("Complete", "Failed")


def quantity(value: Any) -> float:
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(str(value))) if value is not None else 0.0


def pod_gpus(pod: Any) -> int:
    return int(sum(quantity((c.resources.requests or {}).get(GPU)) for c in pod.spec.containers
                   if c.resources and c.resources.requests))


def ready_since(pod: Any) -> str | None:
    """When the pod last turned Ready (its condition's lastTransitionTime), None if not Ready."""
    for c in pod.status.conditions or []:
        if c.type == "Ready" and c.status == "True":
            return c.last_transition_time.isoformat() if c.last_transition_time else None
    return None


def holds_resources(pod: Any, live_owners: set[str]) -> bool:
    """The pod runs or will run: not ended, not being deleted, and its
    controller (RayCluster or submitter Job), if it has one, still stands."""
    if pod.metadata.deletion_timestamp is not None or pod.status.phase in ("Succeeded", "Failed"):
        return False
    controller = next((o for o in pod.metadata.owner_references or [] if o.controller), None)
    return controller is None or controller.uid in live_owners


def workload_of(workloads: Iterable[dict[str, Any]], rayjob: str) -> dict[str, Any] | None:
    for wl in workloads:
        if any(o.get("kind") == "RayJob" and o.get("name") == rayjob for o in wl["metadata"].get("ownerReferences") or []):
            return wl
    return None


def true(obj: dict[str, Any] | None, kind: str) -> bool:
    return bool(obj) and (condition(obj, kind) or {}).get("status") == "True"


def reserved_gpus(wl: dict[str, Any] | None) -> int:
    if not true(wl, "QuotaReserved"):
        return 0
    psa = ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    return int(sum(quantity((a.get("resourceUsage") or {}).get(GPU)) for a in psa))


def assigned_counts(wl: dict[str, Any] | None) -> dict[str, int]:
    """Pods per pod set that the admission covers (empty when not admitted)."""
    if not true(wl, "QuotaReserved"):
        return {}
    psa = ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    return {a["name"]: int(a.get("count") or 0) for a in psa}


def gang_of(rayjob: dict[str, Any]) -> dict[str, Any]:
    """Pods, GPUs and pods per Kueue pod set (head, each worker group) of a
    RayJob's whole gang, from its spec; Kueue adds a ``submitter`` pod set."""
    spec = rayjob["spec"]["rayClusterSpec"]
    gpus = sum(int(g["replicas"]) * int(quantity(g["template"]["spec"]["containers"][0]["resources"]["requests"].get(GPU)))
               for g in spec["workerGroupSpecs"])
    podsets = {"head": 1, **{g["groupName"]: int(g["replicas"]) for g in spec["workerGroupSpecs"]}}
    return {"pods": 1 + mf.worker_count(spec), "gpus": gpus, "podsets": podsets}


def cluster_queue_usage(lab: Any, name: str) -> dict[str, Any]:
    queue = lab.custom.get_cluster_custom_object(
        kueue.GROUP, kueue.VERSION, "clusterqueues", name)  # platform-owned-ok: read only
    status = queue.get("status") or {}
    gpus = sum(quantity(r.get("total")) for f in status.get("flavorsReservation") or [] for r in f.get("resources") or []
               if r.get("name") == GPU)
    return {"reserving": status.get("reservingWorkloads", 0), "admitted": status.get("admittedWorkloads", 0),
            "pending": status.get("pendingWorkloads", 0), "reserved_gpus": int(gpus)}


def suspended_in(rayjob: dict[str, Any] | None) -> bool:
    """Whether a RayJob read (None: not found) has ``spec.suspend``."""
    return bool(rayjob and rayjob["spec"].get("suspend"))


class Sampler:
    """Samples the RayJobs ``jobs`` ({name: namespace}) and ClusterQueue ``cq``.

    ``sample()`` takes one sample and appends it to ``samples``; ``pod_ready``
    keeps, per gang pod ever seen, its GPUs, group and first Ready time
    (pods are deleted when a job ends, so this is where their history stays);
    with ``logs`` the longest log read of each job's submitter pods is kept in
    ``driver_logs`` (a RayJob deleted at the end takes its submitter with it).
    A job whose RayJob does not exist (yet, or any more) is left out of a sample.
    """

    def __init__(self, lab: Any, jobs: dict[str, str], cq: str, *, logs: bool = False):
        self.lab, self.jobs, self.cq, self.logs = lab, dict(jobs), cq, logs
        self.driver_logs: dict[str, str] = {}
        self.began = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.pod_ready: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []

    def sample(self) -> dict[str, Any]:
        namespaces = sorted(set(self.jobs.values()))
        # The reads are not one snapshot, so they bracket the Workloads with
        # the RayJobs. Kueue reserves quota before it unsuspends a RayJob, and
        # suspends it before it releases the quota. A RayJob read before the
        # Workloads cannot show an admission that happened between the two as
        # "unsuspended without quota" (seen on a loaded machine when the
        # Workloads were read first); one read after them cannot show an
        # eviction so (seen when the RayJob read first was still unsuspended
        # and the Workload read next had its quota released). So a RayJob
        # counts as suspended when either read says so.
        rayjobs = {name: self._rayjob(ns, name) for name, ns in self.jobs.items()}
        pods = {ns: self.lab.pods(ns) for ns in namespaces}
        owners = set().union(*(self._live_owners(ns) for ns in namespaces)) if namespaces else set()
        workloads = {ns: self.lab.workloads(ns) for ns in namespaces}
        suspended = {name: suspended_in(job) or suspended_in(self._rayjob(self.jobs[name], name))
                     for name, job in rayjobs.items() if job is not None}
        usage = cluster_queue_usage(self.lab, self.cq)
        at = round(time.monotonic() - self.began, 1)
        jobs = {name: self._job(name, rayjobs[name], suspended[name], workload_of(workloads[ns], name), pods[ns],
                                owners)
                for name, ns in self.jobs.items() if rayjobs[name] is not None}
        if self.logs:
            self._read_logs(pods)
        out = {"t": at, "wall": time.time(), "jobs": jobs, "cq": usage}
        self.samples.append(out)
        return out

    def _rayjob(self, ns: str, name: str) -> dict[str, Any] | None:
        from kubernetes import client

        try:
            return self.lab.ray(ns, "rayjobs", name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _live_owners(self, ns: str) -> set[str]:
        """UIDs of the RayClusters and submitter Jobs in ``ns`` not being deleted."""
        from kubernetes import client

        clusters = self.lab.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters")["items"]
        submitters = client.BatchV1Api(self.lab.api).list_namespaced_job(ns).items
        return ({c["metadata"]["uid"] for c in clusters if not c["metadata"].get("deletionTimestamp")}
                | {j.metadata.uid for j in submitters if j.metadata.deletion_timestamp is None})

    def _read_logs(self, pods: dict[str, list[Any]]) -> None:
        for name, ns in self.jobs.items():
            if any((p.metadata.labels or {}).get("job-name") == name and p.status.phase != "Pending" for p in pods[ns]):
                text = self.lab.submitter_logs(ns, name)
                if len(text) >= len(self.driver_logs.get(name, "")):
                    self.driver_logs[name] = text

    def _job(self, name: str, rayjob: dict[str, Any], suspended: bool, wl: dict[str, Any] | None, pods: list[Any],
             owners: set[str]) -> dict[str, Any]:
        status = rayjob.get("status") or {}
        mine = [p for p in pods if (p.metadata.labels or {}).get("ray.io/cluster", "").startswith(f"{name}-")]
        live = [p for p in mine if holds_resources(p, owners)]
        for p in mine:
            seen = self.pod_ready.setdefault(p.metadata.name, {
                "group": (p.metadata.labels or {}).get("ray.io/group"), "gpus": pod_gpus(p), "ready": None,
                "job": name, "cluster": (p.metadata.labels or {}).get("ray.io/cluster"),
                "created": p.metadata.creation_timestamp.isoformat() if p.metadata.creation_timestamp else None})
            if seen["ready"] is None:
                seen["ready"] = ready_since(p)
        submitters = [p for p in pods if (p.metadata.labels or {}).get("job-name") == name and holds_resources(p, owners)]
        return {
            "suspend": suspended,
            "deploy": status.get("jobDeploymentStatus"),
            "job": status.get("jobStatus"),
            "quota": true(wl, "QuotaReserved"),
            "admitted": true(wl, "Admitted"),
            "finished": true(wl, "Finished"),
            "evicted": true(wl, "Evicted"),
            "reserved_gpus": reserved_gpus(wl),
            "assigned": assigned_counts(wl),
            "pods": len(live),
            "releasing": len(mine) - len(live),
            "ready": sum(1 for p in live if ready_since(p)),
            "pod_gpus": sum(pod_gpus(p) for p in live),
            "pod_names": sorted(p.metadata.name for p in mine),
            "waiting": sorted({c.state.waiting.reason for p in live for c in p.status.container_statuses or []
                               if c.state and c.state.waiting and c.state.waiting.reason}),
            "submitter": len(submitters),
            "conditions": {c["type"]: {"status": c.get("status"), "reason": c.get("reason"),
                                       "at": c.get("lastTransitionTime")}
                           for c in ((wl or {}).get("status") or {}).get("conditions") or []},
            "requeue": ((wl or {}).get("status") or {}).get("requeueState"),
        }

    def safe_sample(self) -> dict[str, Any] | None:
        """A sample, or None (the error kept) when the API did not answer."""
        try:
            return self.sample()
        except Exception as exc:  # noqa: BLE001 - a missed sample is reported, not fatal
            self.errors.append(f"{round(time.monotonic() - self.began, 1)}: {type(exc).__name__}: {exc}"[:300])
            return None

    def in_background(self, interval: float = 1.0) -> "Background":
        return Background(self, interval)


class Background:
    """Runs a :class:`Sampler` in a thread, paced by an Event, until stopped."""

    def __init__(self, sampler: Sampler, interval: float):
        self.sampler, self.interval = sampler, interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="admission-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.sampler.safe_sample()
            if self.stop.wait(self.interval):  # the pause between samples; returns True when stopped
                return

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self.sampler

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def gang_violations(samples: list[dict[str, Any]], gangs: dict[str, dict[str, int]], quota_gpus: int) -> list[str]:
    """Every sampled moment at which a job held part of a gang or the queue held more than its quota.

    A job not finished that has gang pods or a submitter must have its
    Workload's quota reserved for the whole gang; a job whose RayJob is
    Running must have every gang pod; the reservations together must fit the
    ClusterQueue's GPUs.
    """
    bad = []
    for s in samples:
        for name, j in s["jobs"].items():
            gang = gangs[name]
            if j["deploy"] in FINISHED or j["finished"]:
                continue
            where = f"t={s['t']}s {name}"
            if (j["pods"] or j["submitter"]) and not j["quota"]:
                bad.append(f"{where}: {j['pods']} gang pods and {j['submitter']} submitter without quota reserved")
            if not j["suspend"] and not j["quota"]:
                bad.append(f"{where}: RayJob not suspended without quota reserved")
            if j["quota"] and j["reserved_gpus"] != gang["gpus"]:
                bad.append(f"{where}: quota for {j['reserved_gpus']} of the gang's {gang['gpus']} GPUs")
            if j["quota"] and any(j["assigned"].get(ps) != n for ps, n in gang["podsets"].items()):
                bad.append(f"{where}: admission covers pods {j['assigned']}, the gang has {gang['podsets']}")
            if j["pods"] > gang["pods"]:
                bad.append(f"{where}: {j['pods']} gang pods, more than the gang's {gang['pods']}")
            if j["deploy"] == "Running" and j["pods"] + j["releasing"] != gang["pods"]:
                bad.append(f"{where}: Running with {j['pods']} live + {j['releasing']} releasing of "
                           f"{gang['pods']} gang pods")
        held = sum(j["reserved_gpus"] for j in s["jobs"].values() if not j["finished"])
        if held > quota_gpus:
            bad.append(f"t={s['t']}s: {held} GPUs reserved by the jobs, above the ClusterQueue's {quota_gpus}")
    return bad


def compact(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples without pod names and conditions, for evidence."""
    return [{"t": s["t"], "cq": s["cq"],
             "jobs": {n: {k: v for k, v in j.items() if k not in ("pod_names", "conditions")}
                      for n, j in s["jobs"].items()}}
            for s in samples]


def epoch(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def condition_at(samples: list[dict[str, Any]], job: str, kind: str, status: str = "True",
                 reason: str | tuple[str, ...] | None = None) -> float | None:
    """The lastTransitionTime (epoch s) of the first sampled ``kind`` condition of ``job`` in ``status``."""
    for s in samples:
        c = s["jobs"].get(job, {}).get("conditions", {}).get(kind)
        if c and c["status"] == status and reason_matches(c["reason"], reason):
            return epoch(c["at"])
    return None


def condition_t(samples: list[dict[str, Any]], job: str, kind: str, status: str = "True",
                reason: str | tuple[str, ...] | None = None) -> float | None:
    """When the first sampled ``kind`` condition of ``job`` in ``status`` turned so,
    on the sampler's own clock (``t``, monotonic): its lastTransitionTime, placed by
    the wall clock of the sample that first showed it, and never before the
    sample that showed ``job`` without it. Figures measured this way cannot be
    stretched by a step of the wall clock between the transition and a later
    sample (a CI machine's wall clock once moved 57 s against its monotonic
    clock during ADM-4, failing it at "pods gone after 300.2 s" when they had
    gone 242 s after admission), and an API server whose clock is off moves
    them by at most one sample interval."""
    before = None
    for s in samples:
        job_now = s["jobs"].get(job)
        if job_now is None:
            continue
        c = job_now.get("conditions", {}).get(kind)
        if c and c["status"] == status and reason_matches(c["reason"], reason):
            at = s["t"] - max(0.0, s["wall"] - epoch(c["at"]))
            return round(at if before is None else max(at, before), 1)
        before = s["t"]
    return None
