"""The platform's golden templates: how a profile points at them, and that
filling them in sets only what a team sets (no cluster needed)."""
from __future__ import annotations

import http.server
import re
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from core import kueue, timeouts
from core import profile as profile_mod
from core.waiting import wait_for
from fixtures import golden
from fixtures import manifests as mf
from tests.loopback_http import serving

GOLDEN = Path(__file__).resolve().parents[1] / "clusters" / "embedded" / "golden"


def _copy(tmp_path: Path, name: str, change=None) -> Path:
    obj = yaml.safe_load((GOLDEN / name).read_text())
    if change:
        change(obj)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(obj))
    return path


def test_default_templates_are_the_reference_platforms() -> None:
    p = profile_mod.load()
    assert {k: Path(v) for k, v in p["templates"].items()} == {
        "rayJob": GOLDEN / "rayjob.yaml", "rayCluster": GOLDEN / "raycluster.yaml",
        "rayService": GOLDEN / "rayservice.yaml"}
    assert p.worker_gpus == 8 and p.worker_requests["cpu"] == "1"
    assert {k: v["file"] for k, v in p.template_digests().items()} == p["templates"]


def test_a_profile_names_templates_relative_to_its_own_directory(tmp_path: Path) -> None:
    (tmp_path / "golden").mkdir()
    _copy(tmp_path / "golden", "rayjob.yaml", lambda o: o["spec"].update(ttlSecondsAfterFinished=600))
    profile = tmp_path / "platform.yaml"
    profile.write_text("templates:\n  rayJob: golden/rayjob.yaml\n")
    p = profile_mod.load(profile)
    assert p["templates"]["rayJob"] == str(tmp_path / "golden" / "rayjob.yaml")
    assert p.templates["rayJob"]["spec"]["ttlSecondsAfterFinished"] == 600
    assert p["templates"]["rayService"] == str(GOLDEN / "rayservice.yaml"), "the others stay the defaults"
    assert p.digest() != profile_mod.load().digest(), "a changed template is a changed profile"


@pytest.mark.parametrize("change, message", [
    (lambda o: o.update(kind="RayCluster"), "must be one ray.io/v1 RayJob object; got ray.io/v1 RayCluster"),
    (lambda o: o["spec"].pop("rayClusterSpec"), "has no spec.rayClusterSpec"),
    (lambda o: o["spec"]["rayClusterSpec"]["workerGroupSpecs"].append(
        dict(o["spec"]["rayClusterSpec"]["workerGroupSpecs"][0], groupName="more")),
     "must have exactly one worker group in spec.rayClusterSpec.workerGroupSpecs"),
])
def test_a_bad_template_is_one_error_naming_the_field_and_file(tmp_path: Path, change, message: str) -> None:
    path = _copy(tmp_path, "rayjob.yaml", change)
    with pytest.raises(profile_mod.ProfileError, match=re.escape(f"field templates.rayJob: {path} {message}")):
        profile_mod.load({"templates": {"rayJob": str(path)}})


def test_a_missing_template_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(profile_mod.ProfileError, match="field templates.rayService: cannot read"):
        profile_mod.load({"templates": {"rayService": str(tmp_path / "nope.yaml")}})


def test_filling_in_sets_only_what_a_team_sets() -> None:
    p = profile_mod.load()
    job = golden.rayjob(p, "train-1", {"rayproof.io/run": "r"}, "python x.py", workers=3, queue="team",
                        priority_class="rayproof-low", backoff_limit=1)
    fields = golden.suite_set_fields(p.templates["rayJob"], job)
    assert not golden.platform_fields(fields), fields
    assert "metadata.name" in fields and "spec.entrypoint" in fields and "spec.suspend" in fields
    assert f"metadata.labels.{kueue.QUEUE_LABEL}" in fields and f"metadata.labels.{kueue.PRIORITY_LABEL}" in fields
    assert "spec.rayClusterSpec.workerGroupSpecs[workers].replicas" in fields
    assert "spec.rayClusterSpec.headGroupSpec.template.spec.containers[ray-head].env[PYTHONPATH]" in fields
    assert f"spec.rayClusterSpec.headGroupSpec.template.spec.volumes[{golden.WORKLOADS_VOLUME}]" in fields
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["workerGroupSpecs"][0]["replicas"] == 3
    # What the platform decided is there as the template has it.
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["ttlSecondsAfterFinished"] == 0
    head = golden.head_container(job)
    assert {"name": "COLLECTIVE_TIMEOUT_S", "value": "60"} in head["env"]
    assert head["resources"] == p.templates["rayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"][
        "spec"]["containers"][0]["resources"]
    assert p.templates["rayJob"]["metadata"]["name"] == "training", "the template itself is untouched"


def test_a_job_sent_to_an_existing_cluster_keeps_the_platforms_submitter() -> None:
    p = profile_mod.load()
    job = golden.rayjob_on_cluster(p, "victim-1", {"rayproof.io/run": "r"}, "python x.py", cluster="team-a")
    template = p.templates["rayJob"]["spec"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "team-a"} and job["spec"]["entrypoint"] == "python x.py"
    assert not set(golden.OWN_CLUSTER_ONLY) & set(job["spec"]), "nothing of a cluster of its own"
    for field in ("submitterPodTemplate", "submitterConfig"):  # the platform's, as the template has them
        assert job["spec"][field] == template[field], field
    assert golden.gcs_redis_address(job) is None
    assert p.templates["rayJob"]["spec"]["rayClusterSpec"], "the template itself is untouched"


def test_the_guard_names_a_platform_owned_field_the_suite_would_change() -> None:
    p = profile_mod.load()
    job = golden.rayservice(p, "s", {}, "applications: []", workers=1)
    job["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = "other:1"
    job["spec"]["rayClusterConfig"].pop("gcsFaultToleranceOptions")
    env = job["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "COLLECTIVE_TIMEOUT_S")["value"] = "1800"
    owned = golden.platform_fields(golden.suite_set_fields(p.templates["rayService"], job))
    assert owned == ["spec.rayClusterConfig.gcsFaultToleranceOptions (removed)",
                     "spec.rayClusterConfig.headGroupSpec.template.spec.containers[ray-head].image",
                     "spec.rayClusterConfig.workerGroupSpecs[workers].template.spec.containers[ray-worker]"
                     ".env[COLLECTIVE_TIMEOUT_S].value"], owned


def test_a_template_whose_volumes_clash_with_the_suites_is_refused(tmp_path: Path) -> None:
    def clash(o):
        o["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"] = [
            {"name": golden.WORKLOADS_VOLUME, "emptyDir": {}}]
    p = profile_mod.load({"templates": {"rayJob": str(_copy(tmp_path, "rayjob.yaml", clash))}})
    with pytest.raises(golden.PlatformFieldChanged, match="already has a volume named"):
        golden.rayjob(p, "j", {}, "true")


@pytest.mark.parametrize("address, service", [
    ("gcs-redis:6379", "gcs-redis"), ("redis://gcs-redis:6379", "gcs-redis"),
    ("gcs-redis.team-a.svc.cluster.local:6379", "gcs-redis"), ("gcs-redis.team-a:6379", "gcs-redis"),
    ("redis.platform-redis.svc:6379", None), ("10.0.0.5:6379", None),
])
def test_the_team_deploys_a_redis_only_where_the_template_points_into_its_namespace(address: str,
                                                                                    service: str | None) -> None:
    assert golden.redis_service_in(address, "team-a") == service


def test_the_suites_gcs_redis_requires_the_templates_password_and_admits_only_ray_pods() -> None:
    """The reference templates name a password Secret; the Redis the suite
    deploys takes it as the head does and keeps it off its command line (run
    here as a node would run the pod's command, on loopback and a free port)."""
    p = profile_mod.load()
    password = golden.gcs_redis_password(golden.rayservice(p, "s", {}, "applications: []", workers=1))
    assert golden.redis_password_secret(password) == ("gcs-redis", "password")
    pod, service, policy = mf.gcs_redis("gcs-redis", {"rayproof.io/run": "r"}, "redis:7.2", password)
    container = pod["spec"]["containers"][0]
    assert container["env"] == [{"name": "REDIS_PASSWORD", **password}]
    assert policy["spec"]["podSelector"] == {"matchLabels": service["spec"]["selector"]}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchExpressions": [
        {"key": "ray.io/cluster", "operator": "Exists"}]}}], "ports": [{"protocol": "TCP", "port": mf.GCS_PORT}]}]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = container["command"][2].replace(f"--port {mf.GCS_PORT}", f"--port {port} --bind 127.0.0.1")
    assert f"--port {port} --bind" in script, container["command"]
    secret = "t3st-gcs-redis-pw"
    server = subprocess.Popen([*container["command"][:2], script], env={"PATH": "/usr/bin:/bin", "REDIS_PASSWORD": secret},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def ping(auth: str | None) -> str:
            env = {"PATH": "/usr/bin:/bin", **({"REDISCLI_AUTH": auth} if auth else {})}
            return subprocess.run(["redis-cli", "-p", str(port), "ping"], env=env, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        assert wait_for(lambda: ping(secret), lambda out: out == "PONG", timeout=timeouts.PROCESS_EXIT,
                        description=f"the GCS Redis on 127.0.0.1:{port} to answer with its password") == "PONG"
        assert "NOAUTH" in ping(None) and "NOAUTH" in ping("wrong")  # refused without it, and with another
        assert secret not in " ".join(psutil.Process(server.pid).cmdline())
    finally:
        server.terminate()
        server.wait(timeout=timeouts.PROCESS_EXIT.seconds)


def test_a_head_on_its_nodes_network_has_the_nodes_addresses_admitted_to_its_gcs_store() -> None:
    """A head with ``hostNetwork`` connects to the GCS store from its node's
    address, which the Ray-pod selector does not match: the team admits the
    nodes' addresses too (SEC-1's self-test runs such a head)."""
    plain = golden.raycluster(profile_mod.load(), "c", {}, workers=1)
    hosted = golden.raycluster(profile_mod.load(), "c", {}, workers=1)
    hosted["spec"]["headGroupSpec"]["template"]["spec"]["hostNetwork"] = True
    assert not golden.head_on_host_network(plain) and golden.head_on_host_network(hosted)
    pod, _, policy = mf.gcs_redis("gcs-redis", {}, "redis:7.2", None)
    nodes = mf.gcs_redis_node_policy("gcs-redis", {}, ["198.18.255.11", "198.18.255.12"])
    assert nodes["spec"]["podSelector"] == policy["spec"]["podSelector"]  # the same Redis pod
    assert nodes["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert nodes["metadata"]["name"] != policy["metadata"]["name"]
    [rule] = nodes["spec"]["ingress"]
    assert rule["from"] == [{"ipBlock": {"cidr": "198.18.255.11/32"}}, {"ipBlock": {"cidr": "198.18.255.12/32"}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": mf.GCS_PORT}]


def test_the_golden_submitter_is_live_only_while_the_dashboard_it_follows_knows_its_job() -> None:
    """The reference RayJob's submitter has a liveness probe on the dashboard
    KubeRay points it at (RAY_DASHBOARD_ADDRESS) asking for its job
    (RAY_JOB_SUBMISSION_ID): run here as the kubelet would run it, it passes
    against an HTTP server that knows the job, and fails within its timeout
    against one that does not (a head recreated in place) and once nothing
    listens there (a head that is gone)."""
    job = profile_mod.load().templates["rayJob"]["spec"]
    pod = job["submitterPodTemplate"]["spec"]
    probe = pod["containers"][0]["livenessProbe"]
    assert pod["restartPolicy"] == "Never" and job["submitterConfig"]["backoffLimit"] == 0
    # A minute without the job ends the submitter, well inside a training clause's wait.
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 60 < timeouts.TRAINING_RUN.seconds
    known = "rayjob-training-x7k2p"

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            self.send_response(200 if self.path == f"/api/jobs/{known}" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "RUNNING"}')

        def log_message(self, *args) -> None:
            pass

    def probe_exit(address: str, submission_id: str) -> int:
        env = {"PATH": "/usr/bin:/bin", "RAY_DASHBOARD_ADDRESS": address, "RAY_JOB_SUBMISSION_ID": submission_id}
        return subprocess.run(probe["exec"]["command"], env=env, capture_output=True,
                              timeout=probe["timeoutSeconds"]).returncode
    with serving(Dashboard) as server:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert probe_exit(address, known) == 0
        assert probe_exit(address, "rayjob-training-other") != 0
    assert probe_exit(address, known) != 0


def test_the_golden_ray_containers_probe_rays_node_health_over_http() -> None:
    """Every Ray container of the reference templates is probed over HTTP at
    the dashboard agent's unified health route (the raylet, and the GCS on a
    head), as KubeRay v1.6 does for Ray 2.53 and later, with KubeRay's
    timings, instead of KubeRay v1.5's bash-and-wget exec. A RayService
    worker's readiness stays KubeRay's, which adds the Serve proxy's health."""
    import ray._private.ray_constants as ray_constants
    from ray.dashboard.modules.reporter import healthz_agent

    assert '@routes.get("/api/healthz")\n    async def unified_health' in Path(healthz_agent.__file__).read_text(), \
        "the installed Ray's dashboard agent serves its unified node health at /api/healthz"
    templates = profile_mod.load().templates
    for kind, template in templates.items():
        spec = golden.cluster_spec_in(template)
        groups = [("head", spec["headGroupSpec"]), *(("worker", g) for g in spec["workerGroupSpecs"])]
        for role, group in groups:
            container = group["template"]["spec"]["containers"][0]
            probes = {"livenessProbe": (30, 120)}
            if not (kind == "rayService" and role == "worker"):
                probes["readinessProbe"] = (10, 10)
            else:
                assert "readinessProbe" not in container, f"{kind} {role}: readiness is KubeRay's (Serve proxy)"
            for name, (delay, failures) in probes.items():
                probe = container[name]
                assert "exec" not in probe and probe["httpGet"] == {
                    "path": "/api/healthz", "port": ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT}, (kind, role)
                assert (probe["initialDelaySeconds"], probe["periodSeconds"], probe["failureThreshold"],
                        probe["timeoutSeconds"]) == (delay, 5, failures, 5 if role == "head" else 2), (kind, role, name)
