"""down() cleans up after an ``up`` that was SIGKILLed halfway.

A CI job that is cancelled, or a developer's Ctrl-\\, kills the process that
runs ``up`` while the control plane is starting; its processes live on in
their own sessions. ``down`` from another process must find them through the
run directory's pidfiles, stop them and remove everything.

A module of its own so that it never overlaps the platform of
``test_controlplane.py`` (two platforms at once overload two cores).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clusters.embedded import build
from clusters.embedded.controlplane import ProcRecord, Supervisor, listening_ports
from clusters.embedded.platform import EmbeddedPlatform
from core import timeouts
from core.waiting import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_down_after_up_was_killed(tmp_path: Path) -> None:
    """After SIGKILL of the process running up() (API server already
    started), down() from another process stops every started process, frees
    its ports and removes the run directory."""
    build.ensure_built(progress=print)
    run_dir = tmp_path / "platform"
    name = f"crash-{os.getpid()}"
    profile = tmp_path / "profile.yaml"  # one node: what is killed here is the control plane's start
    profile.write_text("nodes:\n  count: 1\n  prepullImages: []\n")
    starter = subprocess.Popen(
        [sys.executable, "-m", "clusters.embedded.platform", "up", "--name", name, "--run-dir", str(run_dir),
         "--profile", str(profile), "--wait-for-room"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    platform = EmbeddedPlatform(name, run_dir=run_dir, profile=profile)
    try:
        sup = Supervisor(run_dir)
        wait_for(lambda: sup.running("kube-apiserver") and sup.running("etcd"), timeout=timeouts.PLATFORM_ROOM,
                 description="the starter to have found room and started etcd and the API server")
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        records: list[ProcRecord] = sup.records()
        ports = set(json.loads((run_dir / "state.json").read_text()).get("ports", {}).values())
        assert [r.name for r in records][:2] == ["etcd", "kube-apiserver"], records
        assert all(r.identity_ok() for r in records if r.name in ("etcd", "kube-apiserver"))

        done = platform.down()

        alive = [f"{r.name} (PID {r.pid})" for r in records if r.identity_ok()]
        assert not alive, f"still running after down(): {alive}; down() said {done}"
        assert not ports & listening_ports(), f"still listening: {sorted(ports & listening_ports())}"
        assert not run_dir.exists(), f"{run_dir} left behind; down() said {done}"
    finally:
        if starter.poll() is None:
            os.kill(starter.pid, signal.SIGKILL)
            starter.wait()
        platform.down()
