"""NetworkPolicy: is it enforced (NET-3), does a tightening that blocks
collectives fail training fast (NET-1), does the documented policy let it run (NET-2)."""
from __future__ import annotations

import pytest

from chaos import block_collectives, runner
from conformance.training_jobs import driver_events, gang_gpus, require_fail_fast_timeout, training_rayjob
from fixtures import timeouts
from fixtures.plugin import NOT_APPLICABLE

pytestmark = pytest.mark.slow


def require_enforcement(enforcement: dict, evidence) -> None:
    evidence.record("network_policy_enforcement", enforcement)
    if not enforcement["enforced"]:
        pytest.skip(f"{NOT_APPLICABLE} the cluster does not enforce NetworkPolicy (NET-3 probe: "
                    f"open_without_policy={enforcement['open_without_policy']}, "
                    f"blocked_with_policy={enforcement['blocked_with_policy']})")


@pytest.mark.clause("NET-3")
def test_network_policy_is_enforced(network_policy_enforcement: dict, evidence) -> None:
    """The platform MUST enforce NetworkPolicy: a pod-to-pod TCP connection that
    succeeds without a policy is dropped once a deny-all-ingress policy selects
    the server pod (probed with two pods; seconds until it took effect recorded)."""
    e = evidence.record("probe", network_policy_enforcement)
    assert e["open_without_policy"], f"the probe could not connect even without a policy: {e['before_output']}"
    assert e["blocked_with_policy"], (
        f"a deny-all-ingress NetworkPolicy did not stop connections to {e['server_ip']}:{e['port']} "
        f"(attempts: {e['attempts_after_policy'][-3:]}): this cluster does not enforce NetworkPolicy")


@pytest.mark.clause("NET-1")
def test_policy_blocking_collectives_fails_training_fast(lab, network_policy_enforcement, evidence, tmp_path) -> None:
    """A NetworkPolicy that blocks worker-to-worker traffic, applied before a
    training RayJob starts, MUST make the job fail within the platform's
    collective timeout (itself at most the profile's maxCollectiveTimeout) plus
    60 s slack, counted from when its process group begins to form, with a
    failure reason that names the timeout, and the RayJob MUST reach the Failed
    state instead of hanging."""
    require_enforcement(network_policy_enforcement, evidence)
    timeout_s = require_fail_fast_timeout(lab.profile, evidence, "a blocked collective would hold the gang's GPUs")
    ns = lab.namespace("a")
    lab.queues([ns], gpus=gang_gpus(lab))
    name = lab.name("net1")
    job = training_rayjob(lab, name, steps=8)
    job["metadata"]["namespace"] = ns
    slack = timeouts.FAIL_FAST_SLACK.seconds
    with evidence.phase("inject and observe"):
        journal = runner.run("block-collectives", {
            "kubeconfig": str(lab.kubeconfig), "namespace": ns, "rayjob": job, "rayjob_name": name,
            "labels": lab.labels, "within_s": timeouts.RAYCLUSTER_READY.seconds + timeout_s + slack},
            journal_path=tmp_path / "journal.json")
    evidence.record("experiment", runner.summary(journal))
    evidence.attach_file("chaostoolkit journal", tmp_path / "journal.json")
    outcome = runner.output(journal, "training-finished")
    evidence.record("rayjob", outcome)
    failures = driver_events(lab, ns, name, "failure")
    steps = driver_events(lab, ns, name, "step")
    evidence.record("driver_failure", failures[-1] if failures else None)
    evidence.record("steps_run", len(steps))
    assert outcome["reached"], (
        f"RayJob {name} was still not finished {outcome['elapsed_s']} s after submission with worker-to-worker "
        f"traffic blocked (status {outcome['status']}): the job hangs instead of failing fast")
    assert outcome["status"]["jobStatus"] == "FAILED", (
        f"RayJob {name} ended {outcome['status']} although its workers could not reach each other")
    assert failures, f"the driver of {name} reported no failure event; its output:\n{lab.submitter_logs(ns, name)[-3000:]}"
    failure = failures[-1]
    setups = driver_events(lab, ns, name, "process_group_setup")
    assert setups, f"the driver never reported the process-group setup; its output:\n{lab.submitter_logs(ns, name)[-3000:]}"
    failed_after = evidence.record("failed_after_process_group_setup_s", round(failure["ts"] - setups[0]["ts"], 1))
    evidence.record("failed_after_fit_start_s", failure["seconds"])
    assert failed_after <= timeout_s + slack, (
        f"training failed {failed_after} s after its process group began to form, beyond the collective timeout "
        f"{timeout_s:g} s + {slack:g} s slack")
    assert "timed out" in failure["reason"].lower() or "timeout" in failure["reason"].lower(), (
        f"the failure reason does not name the timeout: {failure['reason']}")
    assert not steps, f"{len(steps)} training steps ran although the collectives were blocked"


@pytest.mark.clause("NET-2")
def test_documented_allow_policy_lets_training_run(lab, network_policy_enforcement, evidence) -> None:
    """Under the platform's documented worker policy (the profile's
    network.workerIngress; by default the design's: default-deny ingress
    except from the same namespace -- GCS, object manager, collectives -- and
    metrics from the monitoring namespace) the same training RayJob MUST
    succeed: the positive control for NET-1."""
    require_enforcement(network_policy_enforcement, evidence)
    ns = lab.namespace("a")
    lab.queues([ns], gpus=gang_gpus(lab))
    ingress = lab.profile["network"]["workerIngress"]
    source = "the design's" if ingress is None else "the profile's network.workerIngress"
    policy = block_collectives.allow(str(lab.kubeconfig), ns, lab.labels, ingress)
    evidence.record("worker_policy", {"source": source, "spec": policy["spec"]})
    name = lab.name("net2")
    lab.create_ray(ns, "rayjobs", training_rayjob(lab, name, steps=8))
    status = lab.wait_rayjob(ns, name, lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                             timeout=timeouts.TRAINING_RUN, description="finished under the allow policy")
    finish = driver_events(lab, ns, name, "finish")
    evidence.record("rayjob", {k: status.get(k) for k in ("jobStatus", "jobDeploymentStatus", "reason", "message")})
    evidence.record("finish", finish[-1] if finish else None)
    assert status.get("jobStatus") == "SUCCEEDED", (
        f"training under the platform's documented worker policy ({source}) ended {status.get('jobStatus')}: "
        f"{status.get('message')}; "
        f"driver output:\n{lab.submitter_logs(ns, name)[-3000:]}")
    assert finish and finish[-1]["step"] == 8, f"the driver did not finish all 8 steps: {finish}"
