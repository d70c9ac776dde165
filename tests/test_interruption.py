"""What an xdist worker could not clean up is swept when its session ends.

A worker unwinds its fixtures when interrupted, but xdist stops it 10 s after
the controller is interrupted, and a worker can also crash or be killed.
These run a small pytest session with the project's plugin and one xdist
worker, as `rayproof test` and `certify` run theirs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fixtures import janitor, netns, timeouts
from fixtures.local_ray import new_run_id
from fixtures.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]


def _session(tmp_path: Path, body: str, *extra: str) -> subprocess.Popen:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RP_OUT": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "fixtures.plugin", "-p", "no:cacheprovider",
                             "-n", "1", "--max-worker-restart=0", "-q", str(tmp_path / "test_inner.py"), *extra],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a signal meant for this test's own group stays out


def _stop(session: subprocess.Popen) -> str:
    if session.poll() is None:
        session.kill()
    return session.communicate(timeout=timeouts.PROCESS_EXIT.seconds)[0]


def test_what_a_killed_worker_owned_is_swept_when_the_session_ends(tmp_path):
    run = new_run_id()
    run_dir = janitor.TMP / f"rayproof-{run}"
    session = _session(tmp_path, f"""
        import os, pathlib, signal, subprocess
        from fixtures import janitor, netns

        def test_worker_dies_holding_a_local_run():
            run_dir = janitor.TMP / "rayproof-{run}"
            run_dir.mkdir()
            janitor.write_owner(run_dir)
            host = netns.Network("{run}").open().add_host("n")
            sleeper = subprocess.Popen(host.prefix() + ["sleep", "600"])
            pathlib.Path(os.environ["RP_OUT"], "sleeper").write_text(str(sleeper.pid))
            os.kill(os.getpid(), signal.SIGKILL)  # no fixture, no finalizer runs
    """)
    sleeper = None
    try:
        session.wait(timeout=timeouts.PYTEST_SESSION.seconds)
        output = _stop(session)
        sleeper = int((tmp_path / "sleeper").read_text())
        assert "swept: run " + run in output, output
        wait_for(lambda: janitor._alive(sleeper), lambda alive: not alive, timeout=timeouts.PROCESS_EXIT,
                 description=f"the killed worker's process {sleeper} to be gone")
        assert not run_dir.exists(), output
        assert netns.list_namespaces(f"rayproof-{run}-") == [], output
    finally:
        if session.poll() is None:
            _stop(session)
        if run_dir.exists():  # what the sweep did not remove, so this test leaves nothing either
            janitor.clean_run(run)
