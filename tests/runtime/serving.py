"""Serve under a head failure: deploy the classifier, drive load, kill the GCS, observe."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from core import timeouts
from core.waiting import wait_for
from fixtures.events import EventLog
from fixtures.local_ray import DASHBOARD_PORT, SERVE_PORT, LocalRayCluster

APP = "classifier"
CONFIG = Path(__file__).resolve().parents[2] / "workloads" / "serve_config.yaml"
# Requests per second: 1000 in the least load run, and little enough CPU that
# the load does not itself keep a restarting head from starting on two cores.
LOAD_RATE = 10
# The least load run: it covers a head restart that goes well (measured
# 40-85 s on 2 busy cores); a longer one is covered too, the load is stopped
# only once the head is back (at most HEAD_RECOVERY later).
LOAD_SECONDS = 100
AVAILABILITY_TARGET = 0.99


def serve_cluster(local_ray, *, gcs_ft: bool) -> LocalRayCluster:
    cluster = local_ray(head_cpus=0, gcs_ft=gcs_ft)
    cluster.add_workers(2)
    return cluster


def serve_details(cluster: LocalRayCluster) -> dict:
    return cluster.http_json(f"http://{cluster.head.ip}:{DASHBOARD_PORT}/api/serve/applications/")


def app_status(cluster: LocalRayCluster) -> str | None:
    apps = serve_details(cluster).get("applications") or {}
    return (apps.get(APP) or {}).get("status")


def deploy(cluster: LocalRayCluster) -> list[str]:
    """Deploy the Serve config through the head's dashboard; return worker proxy URLs once RUNNING."""
    proc = cluster.popen(cluster.head, [sys.executable, "-m", "ray.serve.scripts", "deploy", str(CONFIG),
                                        "--address", f"http://{cluster.head.ip}:{DASHBOARD_PORT}"], "serve-deploy.log")
    rc = wait_for(proc.poll, lambda r: r is not None, timeout=timeouts.SERVE_APP, description="serve deploy to return")
    assert rc == 0, f"serve deploy exited {rc}: {(cluster.workdir / 'serve-deploy.log').read_text()[-2000:]}"
    wait_for(lambda: app_status(cluster), lambda s: s == "RUNNING", timeout=timeouts.SERVE_APP,
             description=f"Serve application '{APP}' to be RUNNING")
    worker_ips = {w.ip for w in cluster.workers}

    def worker_proxies() -> list[str]:
        proxies = serve_details(cluster).get("proxies") or {}
        return sorted(p["node_ip"] for p in proxies.values() if p.get("status") == "HEALTHY" and p["node_ip"] in worker_ips)

    # Clients reach Serve through worker proxies only, like a RayService's
    # serve Service with the head excluded.
    ips = wait_for(worker_proxies, bool, timeout=timeouts.SERVE_APP, description="a healthy Serve proxy on a worker")
    return [f"http://{ip}:{SERVE_PORT}/" for ip in ips]


def start_load(cluster: LocalRayCluster, targets: list[str], log_name: str = "load.log"):
    argv = [sys.executable, "-m", "workloads.load_gen", f"--rate={LOAD_RATE}",
            f"--duration={LOAD_SECONDS + timeouts.HEAD_RECOVERY.seconds:g}",
            "--timeout=2", "--concurrency=16"] + [f"--target={t}" for t in targets]
    return cluster.popen(cluster.client, argv, log_name), EventLog(cluster.workdir / log_name)


def availability_between(seconds: list[dict], start: float, end: float) -> dict:
    inside = [s for s in seconds if s["window_start"] + 1 >= start and s["window_start"] <= end]
    ok = sum(s["ok"] for s in inside)
    fail = sum(s["fail"] for s in inside)
    return {"seconds": len(inside), "ok": ok, "failed": fail,
            "availability": round(ok / (ok + fail), 6) if ok + fail else None}


def kill_gcs_under_load(cluster: LocalRayCluster, evidence) -> tuple[object, EventLog, float]:
    """Deploy, start load, kill the GCS, restart the head; return (load process, its log, kill time)."""
    targets = evidence.record("serve_targets", deploy(cluster))
    load, log = start_load(cluster, targets)
    log.wait_for("second", timeout=timeouts.SERVE_APP, description="load generator to report its first second")
    old_head = cluster.head.proc
    killed_at = time.time()
    evidence.record("killed_gcs_pid", cluster.kill_gcs())
    # `ray start --block` exits once a child dies unexpectedly: the head container ends.
    wait_for(old_head.poll, lambda rc: rc is not None, timeout=timeouts.PROCESS_EXIT,
             description="head process to exit after its GCS was killed")
    evidence.record("head_exit_code", old_head.returncode)
    cluster.restart_head()
    return load, log, killed_at


def finish_load(load, log: EventLog, evidence, *, not_before: float) -> tuple[dict, list[dict]]:
    """Keep the load on until ``not_before`` (and at least LOAD_SECONDS), then stop it and read its seconds."""
    first = log.wait_for("second", timeout=timeouts.SERVE_APP, description="load generator to report its first second")
    end = max(not_before, first["window_start"] + LOAD_SECONDS)
    wait_for(time.time, lambda now: now >= end, timeout=timeouts.Tier(
        "load_run", LOAD_SECONDS + timeouts.PROCESS_EXIT.seconds, "the least load run"),
        description="the load run to cover the event")
    if load.poll() is None:
        load.terminate()  # SIGTERM: the generator finishes its seconds and prints its summary
    wait_for(load.poll, lambda rc: rc is not None, timeout=timeouts.PROCESS_EXIT,
             description="load generator to finish after SIGTERM")
    summary = log.last("summary")
    assert summary is not None, f"load generator printed no summary; tail:\n{log.tail()}"
    evidence.record("load_summary", {k: summary[k] for k in ("sent", "ok", "failed", "availability", "p50_ms", "p99_ms")})
    return summary, log.events("second")


def check_serve_survives_gcs_loss(cluster: LocalRayCluster, evidence, *, target: float = AVAILABILITY_TARGET) -> None:
    """With GCS FT, Serve keeps answering while the GCS is down and the application is RUNNING again after."""
    load, log, killed_at = kill_gcs_under_load(cluster, evidence)

    def status_with_restarts() -> str | None:
        cluster.ensure_head_running()
        return app_status(cluster)

    wait_for(status_with_restarts, lambda s: s == "RUNNING", timeout=timeouts.HEAD_RECOVERY,
             description=f"Serve application '{APP}' RUNNING again on the restarted head")
    recovered_at = time.time()
    evidence.record("head_restarts", cluster.head.restarts)
    evidence.record("kill_to_app_running_s", round(recovered_at - killed_at, 2))
    summary, seconds = finish_load(load, log, evidence, not_before=recovered_at + 2)
    during = evidence.record("during_event", availability_between(seconds, killed_at, recovered_at))
    load_end = summary["started"] + summary["duration_s"]
    evidence.record("event_covered_by_load_s", round(min(recovered_at, load_end) - killed_at, 1))
    assert during["ok"] + during["failed"] > 0, "no requests were sent while the GCS was down"
    assert during["availability"] >= target, (
        f"availability while the GCS was down was {during['availability']:.4f} "
        f"({during['failed']} of {during['ok'] + during['failed']} requests failed), below the target {target}")


def check_gcs_loss_without_ft_is_reported(cluster: LocalRayCluster, evidence) -> None:
    """Without GCS FT the same kill loses the Serve application; the loss is observed, not hung on."""
    load, log, killed_at = kill_gcs_under_load(cluster, evidence)

    def details_with_restarts() -> dict:
        cluster.ensure_head_running()
        return serve_details(cluster)

    status = wait_for(details_with_restarts, lambda d: d is not None, timeout=timeouts.HEAD_RECOVERY,
                      description="the restarted head's dashboard to answer")
    evidence.record("head_restarts", cluster.head.restarts)
    apps = status.get("applications") or {}
    evidence.record("applications_after_restart", {k: v.get("status") for k, v in apps.items()})
    summary, seconds = finish_load(load, log, evidence, not_before=killed_at + LOAD_SECONDS)
    evidence.record("after_kill", availability_between(seconds, killed_at, killed_at + LOAD_SECONDS))
    assert APP not in apps, (
        f"without GCS fault tolerance the restarted head still knows application '{APP}' ({apps[APP].get('status')}): "
        "the kill did not take effect")
