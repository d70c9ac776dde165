"""The local building blocks, for real: namespaces that drop packets, cgroups that OOM-kill, the janitor."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from core import locks, processes, timeouts
from core.cgroups import MemoryCgroup
from core.ray_agent import AGENT_STARTUP_NICE, favour_dashboard_agent_while_starting
from core.waiting import wait_for
from fixtures import janitor, netns
from fixtures.local_ray import STARTUP_RESTARTS, RayNodeExited, new_run_id

REPO = Path(__file__).resolve().parents[1]

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
    (locks.run_record(run) / "owner").write_text(dataclasses.replace(processes.me(), pid=dead.pid).token)
    live_run = new_run_id()
    live_dir = locks.run_record(live_run)
    processes.write_owner(live_dir)
    try:
        assert run in janitor.orphaned_runs()
        assert live_run not in janitor.orphaned_runs()
        removed = janitor.clean_run(run)
        assert f"process {sleeper.pid}" in removed
        sleeper.wait()
        assert netns.list_namespaces(f"rayproof-{run}-") == []
        assert not run_dir.exists() and not locks.run_record(run).joinpath("owner").exists()
        assert live_dir.exists()
    finally:
        sleeper.kill()
        net.close()
        live_dir.joinpath("owner").unlink()
        live_dir.rmdir()


def test_an_owner_planted_under_tmp_is_never_acted_on():
    """Any local user can write /tmp/rayproof-<run>/owner with a dead process's
    token; `clean` reads owners only from the runtime directory."""
    run = new_run_id()
    planted = janitor.TMP / f"rayproof-{run}"
    planted.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        (planted / "owner").write_text(dataclasses.replace(processes.me(), pid=dead.pid).token)
        assert run not in janitor.orphaned_runs()
    finally:
        shutil.rmtree(planted)


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
    assert not is_orphaned(platform), "no users recorded: brought up by `rayproof up`, never taken down by a session"
    users = platform.run_dir / "users"
    processes.join_users(users)
    assert not is_orphaned(platform), "its session (this process) is alive"
    (users / "999999999").write_text("1.0")
    (users / str(os.getpid())).write_text("1.0")  # this PID, but not this process (a recycled PID)
    assert platform.session_users() == [] and is_orphaned(platform)


def test_the_last_session_to_leave_a_shared_platform_takes_it_down(tmp_path, monkeypatch):
    """pytest-xdist workers and the certify command share one platform: one
    worker finishing must not take it down under the others."""
    from clusters.embedded.platform import EmbeddedPlatform

    platform = EmbeddedPlatform("shared-check", run_dir=tmp_path / "shared-check")
    platform.run_dir.mkdir()
    torn_down = []
    monkeypatch.setattr(platform, "_teardown", lambda: torn_down.append(True) or ["stopped"])
    other = subprocess.Popen(["sleep", "600"])
    try:
        processes.join_users(platform.run_dir / "users")
        other_owner = dataclasses.replace(processes.me(), pid=other.pid, started=processes.started_since_boot(other.pid))
        (platform.run_dir / "users" / str(other.pid)).write_text(other_owner.token)
        assert platform.leave() == [] and not torn_down, "another session still uses it"
        assert platform.session_users() == [other.pid]
    finally:
        other.kill()
        other.wait()
    assert platform.leave() == ["stopped"], "its last user is gone: the platform comes down"
    assert not platform.run_dir.joinpath("users", str(os.getpid())).exists()


def test_a_session_killed_inside_its_platforms_teardown_leaves_it_to_its_sessions_sweep(tmp_path):
    """An interrupted pytest-xdist worker is stopped by xdist 10 s later,
    inside the teardown of four real nodes: the platform must still name that
    worker among its users, or its session's sweep (of what its own workers
    left) passes it by and it stays up until `rayproof clean`."""
    from clusters.embedded.platform import EmbeddedPlatform

    run_dir, inside = tmp_path / "killed-in-teardown", tmp_path / "inside-the-teardown"
    run_dir.mkdir()
    worker_code = (
        "import pathlib, threading\n"
        "from clusters.embedded.platform import EmbeddedPlatform\n"
        "from core import processes\n"
        f"platform = EmbeddedPlatform('killed-in-teardown', run_dir=pathlib.Path({str(run_dir)!r}))\n"
        "processes.join_users(platform.run_dir / 'users')\n"
        f"platform._teardown = lambda: pathlib.Path({str(inside)!r}).touch() or threading.Event().wait()\n"
        "platform.leave()\n")
    worker = subprocess.Popen([sys.executable, "-c", worker_code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for(inside.exists, timeout=timeouts.PROCESS_EXIT, description="the worker to be inside its teardown")
    finally:
        worker.kill()
        worker.wait()
    platform = EmbeddedPlatform("killed-in-teardown", run_dir=run_dir)
    assert janitor.left_by(platform, {worker.pid}), "the killed worker's session sweeps it"
    assert not janitor.left_by(platform, {os.getpid()}), "a session it never served passes it by"


def test_every_run_against_one_embedded_platform_uses_one_directory_of_shares(tmp_path):
    """Its API server comes up on a new port each time: the shares are keyed by
    the platform, not the port, or every run would leave a directory behind."""
    from types import SimpleNamespace

    from clusters.embedded.target import EmbeddedTarget
    from fixtures import sharing

    def shares_of(name: str) -> sharing.ClusterShares:
        platform = SimpleNamespace(name=name, run_dir=tmp_path / "platforms" / name)
        return sharing.ClusterShares(EmbeddedTarget(platform).identity, 2, root=tmp_path / "shares")

    assert shares_of("default").dir == shares_of("default").dir != shares_of("selftest").dir
    assert len(list((tmp_path / "shares").iterdir())) == 2


def test_clauses_side_by_side_hold_shares_and_one_needing_all_is_not_overtaken(tmp_path):
    from fixtures import sharing

    shares = sharing.ClusterShares("https://cluster.example:6443", 2, root=tmp_path)
    with shares.hold(1) as waited_first, shares.hold(1) as waited_second:
        assert waited_first < 1 and waited_second < 1, "two one-gang clauses fit a two-gang cluster at once"
        assert shares._take(1) is None, "a third gang does not fit"
    got_all = threading.Event()
    release_all = threading.Event()

    def needs_all() -> None:
        with shares.hold(2):
            got_all.set()
            release_all.wait(timeouts.PROCESS_EXIT.seconds)

    first = shares.hold(1)
    first.__enter__()
    whole = threading.Thread(target=needs_all)
    whole.start()
    try:
        def turnstile_taken() -> bool:
            fd = sharing._try_lock(shares.dir / "turnstile")
            if fd is not None:
                os.close(fd)
            return fd is None

        # A newcomer needing one share would find one free, but queues behind the turnstile.
        wait_for(turnstile_taken, timeout=timeouts.PROCESS_EXIT,
                 description="the clause needing every share to wait at the turnstile")
        assert not got_all.is_set(), "it cannot hold every share while another clause holds one"
    finally:
        first.__exit__(None, None, None)
    try:
        wait_for(got_all.is_set, timeout=timeouts.PROCESS_EXIT, description="the clause needing every share to get them")
        assert shares._take(1) is None, "while it holds every share, nothing else fits"
    finally:
        release_all.set()
        whole.join(timeouts.PROCESS_EXIT.seconds)
    again = shares._take(2)
    assert again is not None, "all shares are free again"
    for fd in again:
        os.close(fd)


def _nodes(count: int, cpu: str, memory: str = "16Gi", gpus: str = "8") -> object:
    """A node listing as the API returns it: ``count`` Ready nodes of one allocatable."""
    from kubernetes.client import V1Node, V1NodeCondition, V1NodeList, V1NodeSpec, V1NodeStatus, V1ObjectMeta

    return V1NodeList(items=[V1Node(
        metadata=V1ObjectMeta(name=f"node-{i}"), spec=V1NodeSpec(),
        status=V1NodeStatus(conditions=[V1NodeCondition(type="Ready", status="True")],
                            allocatable={"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus, "pods": "110"}))
        for i in range(count)])


@pytest.mark.parametrize("cpu, gangs", [
    ("4", 2),  # the profile's shape on a machine of 4 cores or more: a worker beside a head and a submitter
    ("2", 1),  # a real node on this machine: two gangs fit the total of 8 CPUs, not any placement of their heads
    ("96", 2),  # a GPU fleet's node: its GPUs bind
])
def test_shares_count_the_workers_each_node_holds_beside_a_head_and_a_submitter(monkeypatch, cpu, gangs):
    from kubernetes import client

    from clusters.preflight import workers_that_fit
    from core import profile as profile_mod
    from fixtures.sharing import gangs_that_fit

    profile = profile_mod.load()
    assert profile.worker_requests == {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "8"}
    assert profile.gang_companion_requests == {"cpu": "1.5", "memory": "4504682496"}, \
        "the head (1 CPU, 4Gi) and KubeRay's default submitter (500m, 200Mi)"
    monkeypatch.setattr(client.CoreV1Api, "list_node", lambda self, **kw: _nodes(4, cpu))
    assert workers_that_fit(None, profile) == 4, "one worker per node by its GPUs, whatever the CPUs"
    assert gangs_that_fit(None, profile) == gangs
    monkeypatch.setattr(client.CoreV1Api, "list_node", lambda self, **kw: _nodes(4, "96", memory="3Gi", gpus="16"))
    assert workers_that_fit(None, profile) == 4, "memory binds: GPUs for two workers a node, memory for one"


def test_host_slots_cap_work_on_this_machine_and_pass_to_children(tmp_path, monkeypatch):
    """As many holders at once as slots; a process holding one (or whose
    ancestor does) takes no second; a third holder waits, naming the slots."""
    from fixtures import sharing

    monkeypatch.setenv(sharing.HOST_SLOTS_ENV, "2")
    monkeypatch.delenv(sharing.HOST_SLOT_HELD_ENV, raising=False)
    monkeypatch.setenv("RAYPROOF_TIMEOUT_CLUSTER_SHARE", "2")
    root = tmp_path / "slots"
    with sharing.host_slot(root) as waited:
        assert waited < 1 and os.environ[sharing.HOST_SLOT_HELD_ENV] == str(os.getpid())
        with sharing.host_slot(root) as again:
            assert again == 0.0, "a process holding a slot takes no second one"
        child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({sharing.HOST_SLOT_HELD_ENV!r}))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(os.getpid()), "a child inherits its parent's slot"
        other = sharing.host_slots(root)._take(1)
        assert other is not None, "two slots: a second holder gets one"
        try:
            assert sharing.host_slots(root)._take(1) is None, "no third holder beside two"
            monkeypatch.delenv(sharing.HOST_SLOT_HELD_ENV)
            with pytest.raises(sharing.SharesNotFree,
                               match=r"not judged: .*1 of the 2 shares of this machine's CPUs \(RAYPROOF_HOST_SLOTS=2\)"):
                with sharing.host_slot(root):
                    pass
        finally:
            for fd in other:
                os.close(fd)
    assert sharing.HOST_SLOT_HELD_ENV not in os.environ, "leaving the slot forgets it"
    with sharing.host_slot(root, count=2):
        assert sharing.host_slots(root)._take(1) is None, "work of two gangs holds both slots"
    monkeypatch.setenv(sharing.HOST_SLOTS_ENV, "two")
    with pytest.raises(ValueError, match="RAYPROOF_HOST_SLOTS='two' is not a whole number"):
        sharing.host_slots(root)


def test_a_platform_started_from_other_platform_files_is_not_reused(tmp_path, monkeypatch):
    """A running platform whose onboarding classes, baseline or processes come
    from another checkout (an earlier `rayproof up`) is not the reference
    platform this checkout ships: up() clears it instead of certifying it."""
    from clusters.embedded import platform as platform_mod
    from clusters.embedded.platform import EmbeddedPlatform

    binaries = {"kube-apiserver": tmp_path / "bin" / "kube-apiserver"}
    platform = EmbeddedPlatform("files-check", run_dir=tmp_path / "files-check", binaries=binaries)
    platform.run_dir.mkdir()
    platform.state.update(phase="running", profile_digest=platform.profile.digest(),
                          bin_dir=str(tmp_path / "bin"), files_digest=platform_mod.files_digest())
    monkeypatch.setattr(platform, "health", lambda: {"kube-apiserver": "ok"})
    assert platform._reuse_blocker(binaries) is None
    monkeypatch.setattr(platform_mod, "files_digest", lambda: "0" * 64)
    assert "other files of the reference platform" in (platform._reuse_blocker(binaries) or "")


def test_a_run_asking_another_profile_leaves_a_platform_from_rayproof_up_as_it_is(tmp_path, monkeypatch):
    """A certification naming a platform a user started with `rayproof up`
    and another profile (say, without --platform-profile) is refused with
    what to do, and the platform is not cleared; one a test session started
    is replaced as before."""
    from clusters.embedded.machine import UpRefused
    from clusters.embedded.platform import OTHER_PROFILE, EmbeddedPlatform

    binaries = {"kube-apiserver": tmp_path / "bin" / "kube-apiserver"}
    platform = EmbeddedPlatform("kept", run_dir=tmp_path / "kept", binaries=binaries)
    platform.run_dir.mkdir()
    platform.state.update(phase="running", profile_digest="0" * 16, profile_source="/home/me/kubelet4.yaml",
                          bin_dir=str(tmp_path / "bin"))
    monkeypatch.setattr(platform, "health", lambda: {"kube-apiserver": "ok"})
    assert platform._reuse_blocker(binaries) == OTHER_PROFILE
    with pytest.raises(UpRefused, match=r"platform kept, started by `rayproof up` with /home/me/kubelet4.yaml, "
                                        r"runs another platform profile .*\(--platform-profile\)"):
        platform.up(session=True)
    assert platform.state.read()["phase"] == "running", "nothing was cleared"

    monkeypatch.setattr(platform, "_teardown", lambda: [])
    monkeypatch.setattr("clusters.embedded.machine.check_cgroups", lambda: (_ for _ in ()).throw(
        UpRefused("stop here: the replacement would start")))
    platform._users_dir.mkdir()  # a test session's platform, none of its users alive
    with pytest.raises(UpRefused, match="stop here"):
        platform.up(session=True)


def test_a_lock_reached_through_a_symbolic_link_or_a_shared_directory_is_refused(tmp_path):
    """Share locks live in a directory of this user's own: a lock file that is
    a symbolic link (to a file another user wants root to open) and a lock
    directory others may write are refused, naming the path."""
    from core.locks import UnsafePath
    from fixtures import sharing

    shares = sharing.ClusterShares("https://cluster.example:6443", 1, root=tmp_path / "shares")
    target = tmp_path / "not-a-lock"
    target.write_text("someone else's file")
    (shares.dir / "turnstile").symlink_to(target)
    with pytest.raises(UnsafePath, match="turnstile is a symbolic link"):
        with shares.hold(1):
            pass
    assert target.read_text() == "someone else's file"

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafePath, match="has mode 777: others may use it"):
        sharing.ClusterShares("https://cluster.example:6443", 1, root=open_dir)
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "shares", target_is_directory=True)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        sharing.ClusterShares("https://cluster.example:6443", 1, root=linked)


def test_clean_finds_a_platform_kept_in_a_temporary_directory_once_its_owner_is_gone(tmp_path, monkeypatch):
    """A platform a test brings up in its own run directory is linked from the cache until its down, so
    `rayproof clean` (and a session's sweep after its workers) takes it down once the process that
    brought it up has died; one whose owner lives is left, and a link to a removed directory is dropped."""
    from clusters.embedded.platform import EmbeddedPlatform, elsewhere_root, platforms_elsewhere

    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    dead_owner = dataclasses.replace(processes.me(), pid=dead.pid, started=1.0)
    platforms = {}
    for name, owner in (("left-by-dead", dead_owner), ("in-use", processes.me()), ("removed", processes.me())):
        p = platforms[name] = EmbeddedPlatform(name, run_dir=tmp_path / "pytest-tmp" / name / "platform")
        p.run_dir.mkdir(parents=True)
        p.state.update(name=name, owner=owner.token, owner_pid=owner.pid)
        p._link_elsewhere()
    (platforms["removed"].run_dir / "state.json").unlink()
    platforms["removed"].run_dir.rmdir()
    assert sorted(p.name for p in platforms_elsewhere()) == ["in-use", "left-by-dead"]
    assert len(list(elsewhere_root().iterdir())) == 2, "the link to the removed directory is dropped"

    taken_down = []
    monkeypatch.setattr(EmbeddedPlatform, "down", lambda self: taken_down.append(self.run_dir) or [])
    assert janitor.take_down_platforms_elsewhere(owners=[os.getpid()]) == [], "not a worker of this session's"
    done = janitor.take_down_platforms_elsewhere()
    assert taken_down == [platforms["left-by-dead"].run_dir], done
    assert done == [f"took down embedded platform left-by-dead in {platforms['left-by-dead'].run_dir}, left "
                    "running by a process that is gone"]


def test_a_platform_in_the_platform_root_is_not_linked_and_one_elsewhere_is_unlinked_at_down(tmp_path, monkeypatch):
    from clusters.embedded.platform import EmbeddedPlatform, elsewhere_root

    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    named = EmbeddedPlatform("named")
    assert named._elsewhere_link is None
    kept = EmbeddedPlatform("kept", run_dir=tmp_path / "tmp" / "kept")
    kept.run_dir.mkdir(parents=True)
    kept.state.update(name="kept")
    kept._link_elsewhere()
    assert [link.resolve() for link in elsewhere_root().iterdir()] == [kept.run_dir.resolve()]
    kept.down()
    assert not kept.run_dir.exists() and list(elsewhere_root().iterdir()) == []


def test_a_platform_started_on_the_retired_node_agent_comes_down_when_the_agent_left_no_pod(tmp_path, monkeypatch):
    """A platform an older checkout started on the node agent registered the agent's cleanup, whose
    module is gone: with no pod in the agent's records down goes on; with pods left it says which
    checkout still has the agent, and keeps the run directory."""
    from clusters.embedded.platform import LAST_NODE_AGENT_COMMIT, NODE_AGENT_CLEANUP, EmbeddedPlatform

    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    platform = EmbeddedPlatform("old", run_dir=tmp_path / "old")
    state_dir = platform.run_dir / "nodeagent"
    (state_dir / "pods" / "uid-1").mkdir(parents=True)
    platform.state.update(name="old", phase="running", cleanups=[
        {"function": NODE_AGENT_CLEANUP, "kwargs": {"state_dir": str(state_dir)}}])
    with pytest.raises(RuntimeError, match=rf"no longer has.*1 pods.*worktree add \S+ {LAST_NODE_AGENT_COMMIT}"):
        platform.down()
    assert platform.run_dir.is_dir(), "kept for the older checkout's down"
    (state_dir / "pods" / "uid-1").rmdir()  # what the older checkout's down does
    done = platform.down()
    assert any("the retired node agent left no pod" in line for line in done), done
    assert not platform.run_dir.exists()
