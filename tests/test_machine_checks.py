"""What the machine must offer an embedded platform is checked before anything starts: too few
inotify instances is one message saying what to do, exit 4 from certify, and nothing made."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from clusters.embedded import machine
from clusters.embedded.platform import EmbeddedPlatform


def test_an_inotify_instance_this_process_opens_is_counted():
    libc = ctypes.CDLL(None, use_errno=True)
    before = machine.inotify_instances_in_use()
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        # Other processes of this user may open or close their own meanwhile; ours is one of what is counted.
        own = sum(os.readlink(f"/proc/self/fd/{n}") == "anon_inode:inotify" for n in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{n}"))
        assert own >= 1
        assert machine.inotify_instances_in_use() >= own
        assert machine.inotify_instances_in_use(uid=os.getuid() + 12345) == 0  # a user with no processes holds none
    finally:
        os.close(fd)
    assert before >= 0


@pytest.mark.parametrize("nodes, needed", [(4, machine.CONTROL_PLANE_INSTANCES + 4 * machine.REAL_NODE_INSTANCES),
                                           (1, machine.CONTROL_PLANE_INSTANCES + machine.REAL_NODE_INSTANCES)])
def test_a_platform_fits_up_to_the_limit_and_is_refused_past_it(nodes, needed):
    machine.check_inotify("p", nodes, [], limit=128, in_use=128 - needed)  # exactly fits
    with pytest.raises(machine.MachineUnfit) as refused:
        machine.check_inotify("p", nodes, ["default", "other"], limit=128, in_use=129 - needed)
    message = str(refused.value)
    assert f"needs about {needed} inotify instances" in message
    assert f"{129 - needed} of them in use" in message and "hold 128" in message
    assert "here: default, other" in message  # which platforms could go
    assert "sysctl -w fs.inotify.max_user_instances=" in message


def test_up_refuses_a_machine_short_of_inotify_instances_before_starting_anything(tmp_path, monkeypatch):
    limit = tmp_path / "max_user_instances"
    limit.write_text("1\n")
    monkeypatch.setattr(machine, "MAX_USER_INSTANCES", limit)
    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAYPROOF_RUNTIME_DIR", str(tmp_path / "run"))  # not this machine's lock of platform starts
    monkeypatch.setattr(machine, "check_cgroups", lambda: None)  # judged apart, by the machine's mounts
    started = []
    platform = EmbeddedPlatform("short", binaries={"kube-apiserver": Path("/nonexistent/kube-apiserver")})
    monkeypatch.setattr(platform, "control_plane", lambda: started.append("control plane"))
    with pytest.raises(machine.MachineUnfit, match="needs about 52 inotify instances"):  # 20 + 4 nodes at 8
        platform.up()
    assert started == []
    assert not platform.run_dir.exists()  # no run directory, no state, no logs


def test_real_nodes_fit_the_disk_up_to_their_images_and_are_refused_past_it(tmp_path):
    needed = machine.real_nodes_disk_bytes(4, images_shared=False)
    machine.check_disk("p", 4, tmp_path / "not" / "yet", [], images_shared=False, free=needed)  # fits
    with pytest.raises(machine.MachineUnfit) as refused:
        machine.check_disk("p", 4, tmp_path, ["default"], images_shared=False, free=needed - 1)
    message = str(refused.value)
    assert "4 real nodes need about 29 GiB of disk" in message and "6.15 GiB, none of them shared" in message
    assert f"{tmp_path} has 28.6 GiB free" in message
    assert "here: default" in message and "nodes.count" in message
    # Measured where it is asked, from the nearest directory that exists.
    machine.check_disk("p", 0, tmp_path / "not" / "yet", [], images_shared=False)


def test_real_nodes_whose_pre_pulled_images_are_shared_need_two_copies_of_the_ray_image_at_most(tmp_path):
    gib = 2**30
    assert machine.real_nodes_disk_bytes(1, images_shared=True) == int(6.15 * gib) + gib
    assert machine.real_nodes_disk_bytes(4, images_shared=True) == int(2 * 6.15 * gib) + 4 * gib
    assert machine.real_nodes_disk_bytes(4, images_shared=False) == int(4 * 6.15 * gib) + 4 * gib
    shared = machine.real_nodes_disk_bytes(4, images_shared=True)
    with pytest.raises(machine.MachineUnfit, match="about 16 GiB .* two at a time before the copies are shared"):
        machine.check_disk("p", 4, tmp_path, [], images_shared=True, free=shared - 1)


def test_up_refuses_real_nodes_the_disk_cannot_hold_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "check_cgroups", lambda: None)  # judged apart, by the machine's mounts
    monkeypatch.setattr(machine, "REAL_NODE_OWN_BYTES", 2**62)  # more than any disk holds
    monkeypatch.setattr(machine, "check_inotify", lambda *args, **kwargs: None)  # whatever else runs here now
    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAYPROOF_RUNTIME_DIR", str(tmp_path / "run"))
    started = []
    platform = EmbeddedPlatform("short",
                                binaries={"kube-apiserver": Path("/nonexistent/kube-apiserver")})
    monkeypatch.setattr(platform, "control_plane", lambda: started.append("control plane"))
    with pytest.raises(machine.MachineUnfit, match="4 real nodes need about .* GiB of disk"):
        platform.up()
    assert started == []
    assert not platform.run_dir.exists()


def test_certify_on_a_machine_short_of_inotify_instances_exits_4_creating_nothing(tmp_path, monkeypatch, capsys):
    from clusters.embedded import build
    from rayproof import cli

    limit = tmp_path / "max_user_instances"
    limit.write_text("1\n")
    monkeypatch.setattr(machine, "MAX_USER_INSTANCES", limit)
    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAYPROOF_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(build, "ensure_built", lambda progress=None: {"kube-apiserver": Path("/nonexistent/x")})
    monkeypatch.setattr(machine, "check_cgroups", lambda: None)  # judged apart, by the machine's mounts
    out = tmp_path / "report"
    assert cli.main(["certify", "--platform-name", "short", "--out", str(out)]) == cli.PREFLIGHT_EXIT
    err = capsys.readouterr().err
    assert "fs.inotify.max_user_instances" in err and "nothing was created" in err
    assert not (tmp_path / "cache" / "platform" / "short").exists() and not out.exists()


class _Started(Exception):
    """The platform's start began (the test stops it there)."""


def _short_then(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shortfalls: int) -> tuple[EmbeddedPlatform, list[str]]:
    """A platform whose machine is short of inotify instances for the first ``shortfalls`` checks, beside
    another platform on this machine; the checks it made are listed, its start raises :class:`_Started`."""
    from clusters.embedded import platform as platform_mod

    monkeypatch.setenv("RAYPROOF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RAYPROOF_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(machine, "check_cgroups", lambda: None)
    monkeypatch.setattr(machine, "check_disk", lambda *args, **kwargs: None)
    monkeypatch.setattr(platform_mod, "ROOM_POLL_S", 0.01)
    (tmp_path / "cache" / "platform" / "other").mkdir(parents=True)  # another platform holds instances
    checks: list[str] = []

    def check(name, node_count, others, **kwargs):
        checks.append(f"{name} beside {others}")
        if len(checks) <= shortfalls:
            raise machine.MachineUnfit(f"platform {name} needs about 52 inotify instances")

    monkeypatch.setattr(machine, "check_inotify", check)
    platform = EmbeddedPlatform("waits", binaries={"kube-apiserver": Path("/nonexistent/kube-apiserver")})

    def start():
        raise _Started()

    monkeypatch.setattr(platform, "control_plane", start)
    return platform, checks


def test_a_test_runs_platform_waits_for_room_until_the_others_leave_it_some(tmp_path, monkeypatch):
    platform, checks = _short_then(tmp_path, monkeypatch, shortfalls=2)
    said = []
    platform.progress = said.append
    with pytest.raises(_Started):
        platform.up(session=True, wait_for_room=True)
    assert checks == ["waits beside ['other']"] * 3  # short twice, then it started
    assert sum("waiting for another platform to go down" in line for line in said) == 1, said


def test_up_and_certify_refuse_a_machine_short_of_room_at_once_instead_of_waiting(tmp_path, monkeypatch):
    platform, checks = _short_then(tmp_path, monkeypatch, shortfalls=1)
    with pytest.raises(machine.MachineUnfit, match="needs about 52 inotify instances"):
        platform.up(session=True)
    assert checks == ["waits beside ['other']"]


def test_a_test_runs_platform_gives_up_waiting_for_room_at_its_named_bound(tmp_path, monkeypatch):
    from core.waiting import WaitTimeout

    platform, checks = _short_then(tmp_path, monkeypatch, shortfalls=10**6)
    monkeypatch.setenv("RAYPROOF_TIMEOUT_PLATFORM_ROOM", "0.2")
    with pytest.raises(WaitTimeout, match="room on this machine for platform waits") as gave_up:
        platform.up(session=True, wait_for_room=True)
    assert "needs about 52 inotify instances" in str(gave_up.value)  # what it last saw
    assert len(checks) > 1


def test_one_platform_starts_at_a_time_on_this_machine(tmp_path, monkeypatch):
    """The start lock is held from the checks until the start ends: a second start waits for it."""
    import fcntl

    from core.locks import open_lock

    monkeypatch.setenv("RAYPROOF_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("RAYPROOF_TIMEOUT_PLATFORM_ROOM", "0.3")
    said: list[str] = []
    with machine.starts_lock(said.append):
        other = open_lock(tmp_path / "run" / "platform-starts.lock")
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    assert said == []
    from core.waiting import WaitTimeout

    held = open_lock(tmp_path / "run" / "platform-starts.lock")
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with pytest.raises(WaitTimeout, match="another embedded platform on this machine to finish starting"):
            with machine.starts_lock(said.append):
                pass
    finally:
        os.close(held)
    assert said == ["waiting for another embedded platform on this machine to finish starting ..."]


def test_a_test_waits_for_room_holding_nothing_and_not_for_a_platform_that_runs_already(tmp_path, monkeypatch):
    """Before it takes a host slot for a start, a test waits for room without any lock; a platform that
    runs (or starts) already needs none: joining it is up()'s to judge."""
    platform, checks = _short_then(tmp_path, monkeypatch, shortfalls=2)
    platform.wait_for_room()
    assert checks == ["waits beside ['other']"] * 3
    assert not platform.run_dir.exists() and not (tmp_path / "run" / "platform-starts.lock").exists()
    platform.run_dir.mkdir(parents=True)
    platform.state.update(phase="running")
    checks.clear()
    platform.wait_for_room()
    assert checks == []
