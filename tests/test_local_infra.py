"""The local building blocks, for real: namespaces that drop packets, cgroups that OOM-kill, the janitor."""
from __future__ import annotations

import subprocess
import sys
import threading

import psutil
import pytest

from fixtures import janitor, netns, timeouts
from fixtures.cgroups import MemoryCgroup
from fixtures.local_ray import STARTUP_RESTARTS, RayNodeExited, new_run_id
from fixtures.ray_agent import AGENT_STARTUP_NICE, favour_dashboard_agent_while_starting
from fixtures.waiting import wait_for

SERVER = "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); " \
         "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); [s.accept()[0].close() for _ in iter(int, 1)]"
CONNECT = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2); print('connected')"


@pytest.fixture
def network():
    """Function scope; a bridge with two hosts, deleted at teardown."""
    net = netns.Network(new_run_id()).open()
    try:
        yield net
    finally:
        for host in [*net.hosts.values(), net.hub]:
            for pid in netns.namespace_pids(host.netns):
                subprocess.run(["kill", "-9", str(pid)], check=False)
        net.close()


def _connect(src: netns.Host, dst: netns.Host, port: int) -> subprocess.CompletedProcess:
    return subprocess.run(src.prefix() + [sys.executable, "-S", "-c", CONNECT, dst.ip, str(port)],
                          capture_output=True, text=True, timeout=30)


def test_block_drops_traffic_between_two_hosts_and_unblock_restores_it(network):
    a, b = network.add_host("a"), network.add_host("b")
    server = subprocess.Popen(b.prefix() + [sys.executable, "-S", "-c", SERVER, "7000"])
    try:
        wait_for(lambda: _connect(a, b, 7000).stdout.strip(), lambda out: out == "connected",
                 timeout=timeouts.PROCESS_EXIT, description="server in namespace b to accept")
        network.block(a, b)
        blocked = _connect(a, b, 7000)
        assert blocked.returncode != 0 and "timed out" in blocked.stderr, blocked.stderr[-300:]
        network.unblock(a, b)
        assert _connect(a, b, 7000).stdout.strip() == "connected"
    finally:
        server.kill()
        server.wait()


def test_subnet_outside_the_testing_range_is_refused():
    with pytest.raises(ValueError, match="198.18.0.0/15"):
        netns.Network("x", subnet="10.0.0.0/24")


def test_network_close_removes_every_namespace():
    run = new_run_id()
    net = netns.Network(run).open()
    net.add_host("a")
    assert len(netns.list_namespaces(f"rayproof-{run}-")) == 2
    net.close()
    net.close()  # safe to repeat
    assert netns.list_namespaces(f"rayproof-{run}-") == []


def test_memory_limit_oom_kills_with_sigkill():
    cg = MemoryCgroup(f"rayproof-{new_run_id()}", "hog", 64 * 2**20)
    try:
        hog = subprocess.run([sys.executable, "-c", "x = [bytearray(2**20) for _ in range(1024)]"],
                             preexec_fn=cg.join_current_process, timeout=60)
        assert hog.returncode == -9, f"expected SIGKILL from the OOM killer, got {hog.returncode}"
        assert cg.oom_kills() == 1
    finally:
        cg.remove()


def test_janitor_cleans_an_orphaned_run_and_leaves_live_ones(tmp_path):
    run = new_run_id()
    run_dir = janitor.TMP / f"rayproof-{run}"
    run_dir.mkdir()
    net = netns.Network(run).open()
    host = net.add_host("n")
    sleeper = subprocess.Popen(host.prefix() + ["sleep", "600"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / "owner").write_text(f"{dead.pid} 0")
    live_run = new_run_id()
    live_dir = janitor.TMP / f"rayproof-{live_run}"
    live_dir.mkdir()
    janitor.write_owner(live_dir)
    try:
        assert run in janitor.orphaned_runs()
        assert live_run not in janitor.orphaned_runs()
        removed = janitor.clean_run(run)
        assert f"process {sleeper.pid}" in removed
        sleeper.wait()
        assert netns.list_namespaces(f"rayproof-{run}-") == []
        assert not run_dir.exists()
        assert live_dir.exists()
    finally:
        sleeper.kill()
        net.close()
        live_dir.joinpath("owner").unlink()
        live_dir.rmdir()


def test_node_whose_ray_start_exits_while_starting_is_restarted(local_ray):
    """As the kubelet restarts a crashed container: the cluster still comes up, and the restart is counted."""
    cluster = local_ray(head_cpus=0)
    worker = cluster.add_worker(cpus=1)
    worker.proc.kill()  # our own child: `ray start` dies before its node registers
    cluster.wait_for_nodes(2)
    # At least the one restart; a loaded machine can crash the new raylet too (Ray's fixed 15 s agent wait).
    assert 1 <= worker.restarts <= STARTUP_RESTARTS


def test_node_that_keeps_exiting_fails_the_start_at_once_with_its_log(local_ray):
    cluster = local_ray(head_cpus=0)
    cluster.add_worker(cpus=1, resources={"CPU": 1})  # Ray refuses CPU in --resources
    with pytest.raises(RayNodeExited, match=rf"node w1 exited .* {STARTUP_RESTARTS + 1} times; log tail:(.|\n)*CPU"):
        cluster.wait_for_nodes(2)


def test_dashboard_agent_is_favoured_until_its_port_file_exists(tmp_path):
    """A stand-in node: a `ray start` shell whose child runs a file named dashboard/agent.py."""
    agent_py = tmp_path / "ray" / "dashboard" / "agent.py"
    agent_py.parent.mkdir(parents=True)
    agent_py.write_text("import sys; sys.stdin.read()\n")
    temp_dir = tmp_path / "node"
    start = subprocess.Popen(["sh", "-c", f"{sys.executable} -S {agent_py}; exit 0"], stdin=subprocess.PIPE)
    children = lambda: [c.pid for c in psutil.Process(start.pid).children(recursive=True)]  # noqa: E731
    watcher = threading.Thread(target=favour_dashboard_agent_while_starting,
                               args=(children, temp_dir, lambda: start.poll() is None))
    watcher.start()
    try:
        def agent_nice() -> int | None:
            children = psutil.Process(start.pid).children()
            return children[0].nice() if children else None

        wait_for(agent_nice, lambda n: n == AGENT_STARTUP_NICE, timeout=timeouts.PROCESS_EXIT,
                 description="the stand-in dashboard agent to be reniced while it starts")
        port_file = temp_dir / "session_2026_1" / "dashboard_agent_listen_port_0123"
        port_file.parent.mkdir(parents=True)
        port_file.write_text("52365")
        wait_for(agent_nice, lambda n: n == 0, timeout=timeouts.PROCESS_EXIT,
                 description="the stand-in dashboard agent back at nice 0 once its port file exists")
    finally:
        start.stdin.close()  # the stand-in agent reads to EOF, then the shell exits
        start.wait(timeout=30)
        watcher.join(timeout=30)
    assert not watcher.is_alive()


def test_platform_left_by_a_dead_test_session_is_orphaned_and_one_from_rayproof_up_is_not(tmp_path):
    from clusters.embedded.platform import EmbeddedPlatform
    from clusters.embedded.target import is_orphaned

    platform = EmbeddedPlatform("orphan-check", run_dir=tmp_path / "orphan-check")
    platform.run_dir.mkdir()
    assert not is_orphaned(platform), "no owner recorded: brought up by `rayproof up`, never taken down by a session"
    janitor.write_owner(platform.run_dir)
    assert not is_orphaned(platform), "its session (this process) is alive"
    (platform.run_dir / "owner").write_text("999999999 1.0")
    assert is_orphaned(platform)
