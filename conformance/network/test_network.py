"""NetworkPolicy: is it enforced (NET-3), does a tightening that blocks
collectives fail training fast, applied before it starts (NET-1: the
rendezvous) or while it steps (NET-4: the collectives in progress), does the
documented policy let it run and keep other namespaces out (NET-2)."""
from __future__ import annotations

import pytest

from chaos import runner
from conformance.training_jobs import (
    DriverLog,
    collective_timeout_used,
    driver_events,
    gang_gpus,
    promised_fail_fast_bound,
    require_timeout_within,
    training_rayjob,
)
from core import timeouts
from core.cost import record_idle_cost
from core.figures import FAILED_AFTER_PROCESS_GROUP_SETUP_S
from core.selectors import selector_matches
from core.waiting import wait_for
from fixtures import manifests as mf
from fixtures.kube import pod_ready
from fixtures.netprobe import port_probe_result, start_port_probe
from fixtures.plugin import NOT_APPLICABLE

pytestmark = pytest.mark.slow

LOCKDOWN_STEPS = 24  # NET-4's training: long enough to still be stepping well after the lockdown
LOCKDOWN_AFTER_STEP = 4
STEP_TIME_S = 1.0


def require_enforcement(enforcement: dict, evidence) -> None:
    evidence.record("network_policy_enforcement", enforcement)
    if not enforcement["enforced"]:
        pytest.skip(f"{NOT_APPLICABLE} the cluster does not enforce NetworkPolicy on "
                    f"{', '.join(enforcement['unenforced_nodes'])} (NET-3 probe: a connection open with no policy "
                    f"stayed open under a deny-all-ingress policy: {enforcement['attempts_after_policy'][-3:]})")


def blocked_training_setup(lab, enforcement: dict, evidence, stem: str) -> tuple[float, float, str, str]:
    """What NET-1 and NET-4 start from: enforcement (else not applicable), the
    promised fail-fast bound and its slack, a team namespace with its queue,
    and the training job's name."""
    require_enforcement(enforcement, evidence)
    bound_s = promised_fail_fast_bound(lab.profile, evidence)
    ns = lab.namespace("a", gpus=gang_gpus(lab))
    return bound_s, timeouts.FAIL_FAST_SLACK.seconds, ns, lab.name(stem)


@pytest.mark.clause("NET-3")
def test_network_policy_is_enforced(network_policy_enforcement: dict, evidence) -> None:
    """The platform MUST enforce NetworkPolicy on every node a Ray worker may
    run on: on each such node (Ready, schedulable, taints tolerated and
    nodeSelector met by the golden RayCluster's worker pod) a pod-to-pod TCP
    connection that succeeds without a policy is dropped once a deny-all-ingress
    policy selects the server pod (one server per node, one client; seconds
    until it took effect recorded per node)."""
    e = evidence.record("probe", network_policy_enforcement)
    nodes = e["nodes"]
    assert not e["unenforced_nodes"], (
        f"a deny-all-ingress NetworkPolicy did not stop connections to port {e['port']} of the probe's servers on "
        f"{', '.join(e['unenforced_nodes'])}: this cluster does not enforce NetworkPolicy on "
        f"{len(e['unenforced_nodes'])} of {len(nodes)} nodes a Ray worker may run on (last attempts there: "
        + "; ".join(f"{n} {nodes[n]['attempts_after_policy']}" for n in e["unenforced_nodes"]) + ")")


@pytest.mark.clause("NET-1")
def test_policy_blocking_collectives_fails_training_fast(lab, network_policy_enforcement, evidence, tmp_path) -> None:
    """The rendezvous phase (NET-4 certifies the collectives in progress): a
    NetworkPolicy that blocks worker-to-worker traffic, applied before a
    training RayJob starts, so that its process group cannot form, MUST make
    the job fail within the platform's
    promised fail-fast bound (profile training.maxCollectiveTimeout) plus 60 s
    slack, counted from when its process group begins to form, with a failure
    reason that names the timeout; the RayJob MUST reach the Failed state
    instead of hanging, and the collective timeout the training ran with (the
    platform's, never the suite's) MUST be within the bound."""
    bound_s, slack, ns, name = blocked_training_setup(lab, network_policy_enforcement, evidence, "net1")
    job = training_rayjob(lab, ns, name, steps=8)
    with evidence.phase("inject and observe"):
        journal = runner.run("block-collectives", {
            "kubeconfig": str(lab.kubeconfig), "context": lab.context, "namespace": ns,
            "rayjob": job, "rayjob_name": name, "labels": lab.labels,
            "start_within_s": timeouts.RAYCLUSTER_READY.seconds, "within_s": bound_s + slack},
            journal_path=tmp_path / "journal.json")
    evidence.record("experiment", runner.summary(journal))
    evidence.attach_file("chaostoolkit journal", tmp_path / "journal.json")
    started, outcome = runner.output(journal, "training-started"), runner.output(journal, "training-finished")
    evidence.record("rayjob", outcome)
    events = driver_events(lab, ns, name)
    used = collective_timeout_used(events, evidence)
    failures = [e for e in events if e["event"] == "failure"]
    steps = [e for e in events if e["event"] == "step"]
    evidence.record("driver_failure", failures[-1] if failures else None)
    evidence.record("steps_run", len(steps))
    assert started["reached"], (
        f"the driver of RayJob {name} did not start within {started['elapsed_s']} s of submission "
        f"(status {started['status']}{'; ' + started['cause'] if started['cause'] else ''})")
    assert outcome["reached"], (
        f"RayJob {name} was still not finished {outcome['elapsed_s']} s after its driver started, past the promised "
        f"fail-fast bound {bound_s:g} s + {slack:g} s slack, with worker-to-worker traffic blocked (status "
        f"{outcome['status']}): the job hangs instead of failing fast; its process group was given a collective "
        f"timeout of {(used or {}).get('timeout_s')} s (from {(used or {}).get('source')})")
    assert outcome["status"]["jobStatus"] == "FAILED", (
        f"RayJob {name} ended {outcome['status']} although its workers could not reach each other")
    assert failures, f"the driver of {name} reported no failure event; its output:\n{lab.submitter_logs(ns, name)[-3000:]}"
    failure = failures[-1]
    setups = [e for e in events if e["event"] == "process_group_setup"]
    assert setups, f"the driver never reported the process-group setup; its output:\n{lab.submitter_logs(ns, name)[-3000:]}"
    failed_after = evidence.record(FAILED_AFTER_PROCESS_GROUP_SETUP_S, round(failure["ts"] - setups[0]["ts"], 1))
    record_idle_cost(lab.profile, evidence, gang_gpus(lab) * failed_after,
                     "a gang blocked in its collectives until the training failed")
    evidence.record("failed_after_fit_start_s", failure["seconds"])
    assert failed_after <= bound_s + slack, (
        f"training failed {failed_after} s after its process group began to form, beyond the promised bound "
        f"{bound_s:g} s + {slack:g} s slack (collective timeout {used['timeout_s']} s from {used['source']})")
    assert "timed out" in failure["reason"].lower() or "timeout" in failure["reason"].lower(), (
        f"the failure reason does not name the timeout: {failure['reason']}")
    assert not steps, f"{len(steps)} training steps ran although the collectives were blocked"
    require_timeout_within(used, bound_s, "a collective blocked after the process group formed would hold the "
                                          "gang's GPUs")


def worker_reached_from(lab, ns: str, other_ns: str, evidence) -> tuple[dict, dict]:
    """Start a RayCluster from the golden template with one worker in
    ``ns``; a pod of ``ns`` and a pod of ``other_ns`` each try the worker's
    fixed Ray ports at once. Returns (own namespace's probe, the other's);
    the cluster is deleted before it returns."""
    name = lab.name("net2-ports")
    lab.create_ray(ns, "rayclusters", lab.raycluster(ns, name, workers=1))
    worker = wait_for(lambda: [p for p in lab.pods(ns, f"ray.io/cluster={name},ray.io/node-type=worker")
                               if pod_ready(p)],
                      timeout=timeouts.RAYCLUSTER_READY, interval=2,
                      description=f"the worker of RayCluster {ns}/{name} to be Ready")[0]
    ip = worker.status.pod_ip
    own, other = (start_port_probe(lab, n, ip, list(mf.WORKER_PORTS)) for n in (ns, other_ns))
    own, other = port_probe_result(lab, ns, own), port_probe_result(lab, other_ns, other)
    evidence.record("worker_ports", {"worker": worker.metadata.name, "ip": ip, "from_own_namespace": own,
                                     "from_other_namespace": other})
    lab.custom.delete_namespaced_custom_object("ray.io", "v1", ns, "rayclusters", name)
    return own, other


@pytest.mark.clause("NET-2")
def test_platform_worker_policy_lets_training_run(lab, network_policy_enforcement, evidence) -> None:
    """Under the NetworkPolicies the platform's onboarding puts in a team
    namespace (on the reference platform the design's worker policy:
    default-deny ingress into Ray workers except from the same namespace --
    GCS, object manager, collectives -- and metrics from the monitoring
    namespace), a training RayJob MUST succeed, a policy MUST select its
    worker pods (a namespace nothing locks down shows nothing), and that
    policy MUST keep other namespaces out: a pod of another tenant's namespace
    MUST open none of a Ray worker's fixed ports (metrics 8080, dashboard
    agent 52365) that a pod of the worker's own namespace opens in the same
    window (the probe's control). The positive control for NET-1."""
    require_enforcement(network_policy_enforcement, evidence)
    ns = lab.namespace("a", gpus=gang_gpus(lab))
    name = lab.name("net2")
    lab.create_ray(ns, "rayjobs", training_rayjob(lab, ns, name, steps=8))
    worker_labels = wait_for(lambda: [dict(p.metadata.labels or {}) for p in lab.pods(ns, "ray.io/node-type=worker")],
                             timeout=timeouts.RAYCLUSTER_READY, interval=2,
                             description=f"the worker pods of RayJob {ns}/{name}")
    status = lab.wait_rayjob(ns, name, lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                             timeout=timeouts.TRAINING_RUN, description="finished under the platform's policies")
    finish = driver_events(lab, ns, name, "finish")
    evidence.record("rayjob", {k: status.get(k) for k in ("jobStatus", "jobDeploymentStatus", "reason", "message")})
    evidence.record("finish", finish[-1] if finish else None)
    policies = lab.net.list_namespaced_network_policy(ns).items  # platform-owned-ok: read
    selecting = evidence.record("worker_policies", {
        p.metadata.name: lab.api.sanitize_for_serialization(p.spec) for p in policies
        if any(selector_matches(lab.api.sanitize_for_serialization(p.spec.pod_selector), labels)
               for labels in worker_labels)})
    assert status.get("jobStatus") == "SUCCEEDED", (
        f"training under the platform's worker policies ({', '.join(selecting) or 'none'}) ended "
        f"{status.get('jobStatus')}: {status.get('message')}; driver output:\n{lab.submitter_logs(ns, name)[-3000:]}")
    assert finish and finish[-1]["step"] == 8, f"the driver did not finish all 8 steps: {finish}"
    assert selecting, (
        f"no NetworkPolicy of the platform selects the Ray worker pods of team namespace {ns} (policies there: "
        f"{sorted(p.metadata.name for p in policies) or 'none'}): the workers accept traffic from anywhere, so "
        "the platform documents no worker policy for the training to be checked under")
    with evidence.phase("isolation"):
        own, other = worker_reached_from(lab, ns, lab.namespace("b", own_tenant=True), evidence)
    reached = sorted(p for p, seen in own["ports"].items() if seen["open"])
    assert reached, (
        f"a pod of the worker's own namespace {ns} opened none of its ports {list(mf.WORKER_PORTS)} within "
        f"{own['window_s']:g} s, so the probe shows nothing about what the policy keeps out: {own['ports']}")
    let_in = [p for p in reached if other["ports"][p]["open"]]
    assert not let_in, (
        f"a pod of another team's namespace {other['namespace']} opened the Ray worker's ports {let_in} under the "
        f"platform's worker policies ({', '.join(selecting)}): the workers accept connections from other "
        "namespaces, so the policy selects them and keeps nothing out")


@pytest.mark.clause("NET-4")
def test_lockdown_during_training_never_leaves_it_hanging(lab, network_policy_enforcement, evidence,
                                                          tmp_path) -> None:
    """The collectives in progress, the design's incident (NET-1 certifies
    the rendezvous): a NetworkPolicy that blocks worker-to-worker traffic,
    applied while a training RayJob is stepping (the design's "someone locked
    down the namespace"), MUST never leave the training hanging: within the platform's
    promised fail-fast bound (profile training.maxCollectiveTimeout) plus 60 s
    slack of the policy taking effect, the RayJob MUST have reached a terminal
    state, either Failed with a reason that names the timeout (the platform
    cuts connections already open) or Succeeded with every step done (it keeps
    them, as Calico and Antrea do)."""
    bound_s, slack, ns, name = blocked_training_setup(lab, network_policy_enforcement, evidence, "net4")
    lab.create_ray(ns, "rayjobs", training_rayjob(lab, ns, name, steps=LOCKDOWN_STEPS, step_time_s=STEP_TIME_S))
    log = DriverLog(lab, ns, name)
    with evidence.phase("steady state"):
        wait_for(log.refresh, lambda ev: any(e["event"] == "failure" for e in ev)
                 or any(e["event"] == "step" and e["step"] >= LOCKDOWN_AFTER_STEP for e in ev),
                 timeout=timeouts.TRAINING_RUN, interval=1,
                 description=f"RayJob {ns}/{name}: training at step {LOCKDOWN_AFTER_STEP}")
    assert not log.events("failure"), f"training failed before the lockdown: {log.events('failure')[-1]}"
    with evidence.phase("inject and observe"):
        journal = runner.run("lockdown-collectives", {
            "kubeconfig": str(lab.kubeconfig), "context": lab.context, "namespace": ns, "labels": lab.labels,
            "rayjob_name": name, "within_s": bound_s + slack}, journal_path=tmp_path / "journal.json")
    evidence.record("experiment", runner.summary(journal))
    evidence.attach_file("chaostoolkit journal", tmp_path / "journal.json")
    locked_at = runner.ended_at(journal, "apply-blocking-policy")
    outcome = evidence.record("rayjob", runner.output(journal, "training-finished"))
    log.refresh()
    used = collective_timeout_used(log.events(), evidence)
    steps = log.events("step")
    failures = log.events("failure")
    evidence.record("last_step_before_lockdown", max((e["step"] for e in steps if e["ts"] <= locked_at), default=None))
    evidence.record("steps_after_lockdown", len([e for e in steps if e["ts"] > locked_at]))
    evidence.record("driver_failure", failures[-1] if failures else None)
    assert outcome["reached"], (
        f"RayJob {name} was still not finished {outcome['elapsed_s']} s after worker-to-worker traffic was "
        f"blocked mid-training, past the promised fail-fast bound {bound_s:g} s + {slack:g} s slack (status "
        f"{outcome['status']}): the job hangs instead of failing fast; its process group was given a collective "
        f"timeout of {(used or {}).get('timeout_s')} s (from {(used or {}).get('source')})")
    if outcome["status"]["jobStatus"] == "SUCCEEDED":
        evidence.record("open_connections", "kept: training went on stepping under the new policy")
        assert max(e["step"] for e in steps) == LOCKDOWN_STEPS, (
            f"RayJob {name} succeeded at step {max(e['step'] for e in steps)} of {LOCKDOWN_STEPS}")
        return
    evidence.record("open_connections", "cut: training failed under the new policy")
    assert failures, f"the driver of {name} reported no failure event; its output:\n{lab.submitter_logs(ns, name)[-3000:]}"
    evidence.record("failed_after_lockdown_s", round(failures[-1]["ts"] - locked_at, 1))
    assert "timed out" in failures[-1]["reason"].lower() or "timeout" in failures[-1]["reason"].lower(), (
        f"training failed after the lockdown, but the reason does not name the timeout: {failures[-1]['reason']}")
