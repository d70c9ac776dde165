"""The benchmarks' own accounting (the benchmarks themselves run whole certifications and platforms):
the certification benchmark's CPU by component and origin, the nodes benchmark's steps and figures."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.certification import ORIGINS, ProcessCpu, component_of

VENV = "/root/.cache/rayproof/venv-x/bin/python3"
SITE = "/root/.cache/rayproof/venv-x/lib/python3.11/site-packages/ray"
BIN = "/root/.cache/rayproof/bin/bca9e41b3a03e1d1"


def test_components_are_told_apart_by_command_line():
    cases = {
        ("/root/.cache/rayproof/bin/abc/kube-apiserver --etcd-servers=http://127.0.0.1:2379", "kube-apiserver"):
            "kube-apiserver",
        (f"{VENV} -m clusters.embedded.podnet run --kubeconfig k", "python3"): "pod network",
        (f"{VENV} {SITE}/../../bin/ray start --block --head", "ray"): "ray: `ray start`",
        (f"{VENV} /root/.cache/rayproof/venv-x/bin/ray job submit --address http://h:8265 -- python x.py", "ray"):
            "ray: `ray job` (RayJob submitters)",
        (f"{SITE}/core/src/ray/raylet/raylet --dashboard_agent_command={VENV} -u {SITE}/dashboard/agent.py", "raylet"):
            "ray: raylet",
        (f"{VENV} -u {SITE}/dashboard/agent.py --node-id=1", "python3"): "ray: dashboard agent",
        ("ray::DashboardAgent", "ray::Dashboard"): "ray: dashboard agent",
        (f"{VENV} {SITE}/dashboard/dashboard.py --host=0.0.0.0", "python3"): "ray: dashboard",
        ("ray::RayTrainWorker.train_fn", "ray::RayTrainWor"): "ray: training workers",
        (f"{VENV} -c import sys;exec(eval(sys.stdin.readline()))", "python"): "pytest",
        # A worker not yet renamed: its options name the raylet and the GCS.
        (f"{VENV} -u {SITE}/_private/workers/default_worker.py --raylet-name=/tmp/ray/s/sockets/raylet "
         "--gcs-address=10.0.0.1:6379", "python3"): "ray: workers not yet started",
        (f"{VENV} -u {SITE}/_private/runtime_env/agent/main.py --raylet-name=/tmp/ray/s/sockets/raylet", "python3"):
            "ray: runtime-env agent",
        (f"{SITE}/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/s/logs", "gcs_server"): "ray: gcs_server",
        (f"{VENV} -m rayproof bench certification", "python3"): "this benchmark",
        (f"{VENV} -m rayproof certify --out x", "python3"): "pytest",
        ("ray::RuntimeEnvAgent", "ray::RuntimeEnv"): "ray: runtime-env agent",
        ("ray::IDLE", "ray::IDLE"): "ray: IDLE",
        ("ray::JobSupervisor.run", "ray::JobSupervi"): "ray: JobSupervisor",
        ("ray::ServeReplica:app:Model", "ray::ServeRepli"): "ray: ServeReplica",
        ("python /opt/rayproof/workloads/fsdp_train.py --name x", "python"): "ray: job drivers",
        (f"{VENV} -m workloads.load_gen --rate=20", "python3"): "ray: job drivers",
        # The venv's path names the project; that alone does not make a process pytest's.
        (f"{VENV} -m some.tool", "python3"): "python (other)",
        (f"ray-dashboard-JobHead-0 ({VENV} -c \"from multiprocessing.forkserver import main\")", "ray-dashboard-J"):
            "ray: dashboard",
        ("/usr/bin/redis-server 0.0.0.0:6379", "redis-server"): "redis (GCS fault tolerance)",
        ("/usr/bin/python3 /tmp/x.py", "python3"): "python (other)",
        ("/usr/sbin/sshd -D", "sshd"): "other",
        # The nodes' programs, from the build's bin directory.
        (f"{BIN}/kubelet --config /r/nodes/n1/kubelet.yaml --kubeconfig k", "kubelet"): "kubelet",
        (f"{BIN}/containerd --config /r/nodes/n1/containerd.toml", "containerd"): "containerd",
        (f"{BIN}/containerd-shim-runc-v2 -namespace k8s.io -id 0123 -address /run/containerd/containerd.sock",
         "containerd-shim"): "containerd shims",
        (f"{BIN}/kube-proxy --config /r/nodes/n1/kube-proxy.yaml", "kube-proxy"): "kube-proxy",
        (f"{BIN}/registry serve /r/registry.yml", "registry"): "node image registry",
        (f"{BIN}/fakegpu --count 8 --id-prefix rayproof-node-1-", "fakegpu"): "fake GPU device plugin",
        (f"{VENV} -m clusters.embedded.nodes.relay --ready /r/relay.ready", "python3"): "node relay",
        (f"{VENV} -m clusters.embedded.nodes.provisioner --kubeconfig k", "python3"): "volume provisioner",
        (f"{VENV} -m clusters.embedded.nodes.oomgroup --ctr {BIN}/ctr --address s", "python3"): "node OOM group",
        (f"{BIN}/ctr --address /run/containerd/containerd.sock events", "ctr"): "node OOM group",
        # A pod's Ray on a real node runs the image's Python, not the venv's.
        ("/usr/bin/python3.11 /usr/local/bin/ray start --head --block", "ray"): "ray: `ray start`",
        ("/usr/local/lib/python3.11/dist-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", "gcs_server"):
            "ray: gcs_server",
    }
    assert {key: component_of(*key) for key in cases} == cases


def test_cpu_used_after_the_first_sample_is_counted_and_earlier_use_is_not():
    marker = "rayproof-test-burner"
    burn = ("import sys, time\n"
            "start = time.process_time()\n"
            "while time.process_time() - start < 0.6: pass\n"
            "print('burnt', flush=True)\n"
            "sys.stdin.read()\n")  # stays alive until the test closes its stdin
    before = subprocess.Popen([sys.executable, "-c", burn, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert before.stdout.readline().strip() == "burnt"  # used 0.6 s before sampling began
        cpu = ProcessCpu(classify=lambda cmdline, name: "burner" if marker in cmdline else "rest")
        cpu.sample()
        after = subprocess.Popen([sys.executable, "-c", burn, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert after.stdout.readline().strip() == "burnt"
            cpu.sample()
        finally:
            after.communicate("")
    finally:
        before.communicate("")
    counted = cpu.by_component().get("burner", 0.0)
    assert cpu.started_by_component().get("burner") == 1  # the later child; the earlier one ran at the first sample
    # The later child's 0.6 s (plus its start-up) is counted; the earlier one's is not.
    assert 0.5 <= counted < 1.15, counted



def test_cpu_of_what_a_test_worker_starts_is_placed_under_the_test_workers():
    # A stand-in xdist worker (execnet's bootstrap command line) starts a child
    # that burns 0.6 s of CPU; the child's CPU goes to the test workers' origin.
    cpu = ProcessCpu()
    cpu.sample()
    burner = ("import sys, time\n"
              "start = time.process_time()\n"
              "while time.process_time() - start < 0.6: pass\n"
              "print('burnt', flush=True)\n"
              "sys.stdin.read()\n")
    code = ("import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {burner!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
            "print(p.stdout.readline().decode().strip(), flush=True)\n"
            "sys.stdin.readline()\n"  # alive, with its child, until told
            "p.stdin.close()\n"
            "p.wait()\n")
    worker = subprocess.Popen([sys.executable, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker.stdin.write(repr(code) + "\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "burnt"
        cpu.sample()  # the child is seen after it burnt
        worker.stdin.write("\n")
        worker.stdin.flush()
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    placed = cpu.by_origin().get(ORIGINS[0][1], 0.0)
    assert placed >= 0.5, cpu.by_origin()


@pytest.mark.parametrize("argv", [["--runtimes", "agent,kubelet"], ["-k", "SEC-1", "--runtimes=kubelet"]])
def test_runtimes_are_gone_with_the_node_agent(argv, capsys):
    from benchmarks import certification

    assert certification.main(argv) == 2
    assert "--runtimes is gone with the node agent" in capsys.readouterr().err


def test_a_run_is_set_beside_the_node_agents_last_certification(tmp_path):
    from benchmarks.certification import LAST_NODE_AGENT, against_node_agent, embedded, out_dir

    figures = {"wall_s": 2031, "machine_busy_cpu_s": 2552, "outcome": {"verdict": "CERTIFIED", "counts": {"passed": 16}},
               "cpu_s_by_component": {"kubelet": 2.0, "containerd": 1.0, "containerd shims": 0.5, "node relay": 0.5,
                                      "ray: raylet": 7.0, "kube-apiserver": 9.0},
               "cpu_s_by_origin": {ORIGINS[1][1]: 6.0, ORIGINS[0][1]: 2.0}}
    compared = against_node_agent(figures)
    assert compared["this run"] == {"verdict": "CERTIFIED", "counts": {"passed": 16}, "wall_s": 2031,
                                    "machine_busy_cpu_s": 2552, "node_layer_cpu_s": 4.0, "pods_cpu_s": 6.0}
    assert compared["node agent (retired; its last figures)"] is LAST_NODE_AGENT
    assert compared["wall_s_ratio"] == 1.5 and compared["machine_busy_cpu_s_ratio"] == 2.0
    assert embedded(["-k", "SEC-1"]) and not embedded(["--kubeconfig", "k"])
    assert out_dir(["--out", str(tmp_path)]) == tmp_path and out_dir(["-k", "SEC-1"]) is None


def test_an_interrupted_interruptions_bench_keeps_the_figures_of_the_runs_that_finished(monkeypatch, tmp_path, capsys):
    """Ctrl-C of `bench interruptions` itself: the finished runs' figures are
    printed and it exits 130, rather than a traceback that loses them."""
    import json

    from benchmarks import interruptions
    from clusters.embedded import platform

    class Up:  # the platform as up() leaves it; nothing is started here
        def __init__(self, *args, **kwargs) -> None:
            pass

        def up(self) -> "Up":
            return self

        def api_client(self) -> None:
            return None

    def one_run(index, mode, at_s, k, out, api):
        if index == 2:
            raise KeyboardInterrupt
        return {"exit_status": 3, "swept_at_next_start": [], "left": {"namespaces": [], "processes": []}}

    monkeypatch.setattr(platform, "EmbeddedPlatform", Up)
    monkeypatch.setattr(interruptions, "one_run", one_run)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert interruptions.main(["--runs", "5", "--seed", "3"]) == 130
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["runs_finished"] == 2 and summary["left_after_next_start"] == {"namespaces": 0, "processes": 0}
    assert "interrupted during run 2" in captured.err


def _burning_tree(cpu_s: float) -> subprocess.Popen:
    """A parent whose child burns ``cpu_s`` of CPU, says so, and both stay
    alive until the parent's stdin closes."""
    burner = ("import sys, time\n"
              "start = time.process_time()\n"
              f"while time.process_time() - start < {cpu_s}: pass\n"
              "print('burnt', flush=True)\n"
              "sys.stdin.read()\n")
    code = ("import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {burner!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
            "print(p.stdout.readline().decode().strip(), flush=True)\n"
            "sys.stdin.read()\n"
            "p.stdin.close()\n"
            "p.wait()\n")
    return subprocess.Popen([sys.executable, "-u", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def test_the_nodes_bench_counts_what_a_node_layer_process_started_and_sums_only_the_node_layer():
    from benchmarks.nodes import summarize, tree_cpu_s

    tree = _burning_tree(0.5)
    try:
        pids = {"kubelet-1": tree.pid, "kube-apiserver": tree.pid}
        before = tree_cpu_s(pids)
        assert tree.stdout.readline().strip() == "burnt"
        used = {name: after - before[name] for name, after in tree_cpu_s(pids).items()}
    finally:
        tree.stdin.close()
        tree.wait(timeout=30)
    assert used["kubelet-1"] >= 0.4, used  # the child's CPU counts under the process that started it
    figures = summarize({"kubelet-1": 1.0, "podnet": 0.5, "kube-apiserver": 4.0}, idle_s=10.0,
                        node_layer=["kubelet-1", "podnet"])
    assert figures["idle_cpu_s_node_layer"] == 1.5
    assert figures["idle_core_share_node_layer"] == 0.15
    assert figures["idle_cpu_s_platform"] == 5.5
    assert tree_cpu_s({"gone": tree.pid}) == {"gone": 0.0}


def test_the_nodes_bench_sets_the_node_layer_beside_the_retired_node_agents_last_figures():
    from benchmarks.nodes import LAST_NODE_AGENT, NODE_AGENT_COLUMN, SIDE_BY_SIDE, node_layer, side_by_side

    names = ["etcd", "kube-apiserver", "podnet", "registry", "relay", "containerd-1", "kubelet-1", "containerd-2",
             "kubelet-2", "kube-router-1", "onboarding", "kueue"]
    assert node_layer(names) == ["podnet", "registry", "relay", "containerd-1", "kubelet-1", "containerd-2",
                                 "kubelet-2", "kube-router-1"]
    table = side_by_side([{"up_s": 25.0, "down_s": 9.0}, {"up_s": 35.0}, {"up_s": 30.0}])
    assert table["up_s"] == {NODE_AGENT_COLUMN: 19.9, "kubelet": 30.0}
    assert table["down_s"] == {NODE_AGENT_COLUMN: 13.6, "kubelet": 9.0}
    assert side_by_side([])["rss_mib_node_layer"] == {NODE_AGENT_COLUMN: 128, "kubelet": None}
    assert set(SIDE_BY_SIDE) <= set(LAST_NODE_AGENT), "every figure has the node agent's beside it"


def test_the_nodes_bench_takes_its_platform_down_and_fails_on_what_down_left(monkeypatch, capsys):
    import json

    import benchmarks
    from benchmarks import nodes
    from clusters.embedded import platform

    calls = []
    leftovers = {"network namespaces": set(), "cgroups": set(), "mounts": set()}

    class Record:
        name, pid = "kubelet-1", os.getpid()

        def identity_ok(self) -> bool:
            return True

    class Platform:  # nothing is started: the bench's own steps and figures are what is tested
        def __init__(self, name, **kwargs) -> None:
            assert name == nodes.PLATFORM_NAME  # never the user's default platform
            self.supervisor = type("Supervisor", (), {"records": lambda _self: [Record()]})()

        def binaries(self) -> dict:
            calls.append("build")
            return {}

        def up(self) -> "Platform":
            calls.append("up")
            return self

        def down(self) -> list:
            calls.append("down")
            if calls.count("up") == 2:
                leftovers["cgroups"].add("/sys/fs/cgroup/memory/rayproof-left")
            return []

    monkeypatch.setattr(platform, "EmbeddedPlatform", Platform)
    monkeypatch.setattr(benchmarks, "host_leftovers", lambda: {k: set(v) for k, v in leftovers.items()})
    monkeypatch.setattr(nodes, "ray_image_first_pull", lambda p: (calls.append("pull"), {"image": "ray"})[1])
    assert nodes.main(["--runs", "2", "--idle-s", "0.01"]) == 1
    assert calls == ["down", "build", "up", "pull", "down", "up", "pull", "down"]
    report = json.loads(capsys.readouterr().out)
    first, second = report["runs"]
    assert first["rss_mib_node_layer"] == first["rss_mib_by_process"]["kubelet-1"] > 0  # this process, measured
    assert first["ray_image"] == {"image": "ray"}
    assert first["left_after_down"]["cgroups"] == []
    assert second["left_after_down"]["cgroups"] == ["/sys/fs/cgroup/memory/rayproof-left"]

    # Ctrl-C during the second run's up: that platform is taken down too (up keeps its run directory
    # after an interrupted start), and the first run's figures are kept.
    def interrupted_up(self) -> "Platform":
        calls.append("up")
        if calls.count("up") == 2:
            raise KeyboardInterrupt
        return self

    calls.clear()
    leftovers["cgroups"].clear()
    monkeypatch.setattr(Platform, "up", interrupted_up)
    assert nodes.main(["--runs", "3", "--idle-s", "0.01"]) == 130
    assert calls == ["down", "build", "up", "pull", "down", "up", "down"]
    assert json.loads(capsys.readouterr().out)["runs_finished"] == 1
