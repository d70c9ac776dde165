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

from core import locks, processes, timeouts
from core.waiting import wait_for
from fixtures import janitor, netns
from fixtures.local_ray import new_run_id

REPO = Path(__file__).resolve().parents[1]


def _session(tmp_path: Path, body: str) -> subprocess.Popen:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RP_OUT": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "fixtures.plugin", "-p", "no:cacheprovider",
                             "-n", "1", "--max-worker-restart=0", "-q", str(tmp_path / "test_inner.py")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a signal meant for this test's own group stays out


def _stop(session: subprocess.Popen) -> str:
    if session.poll() is None:
        session.kill()
    return session.communicate(timeout=timeouts.PROCESS_EXIT.seconds)[0]


def test_what_a_killed_worker_owned_is_swept_when_the_session_ends(tmp_path):
    run = new_run_id()
    session = _session(tmp_path, f"""
        import os, pathlib, signal, subprocess
        from fixtures import janitor, netns
        from core import locks, processes

        def test_worker_dies_holding_a_local_run():
            processes.write_owner(locks.run_record("{run}"))
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
        wait_for(lambda: processes.alive(sleeper), lambda alive: not alive, timeout=timeouts.PROCESS_EXIT,
                 description=f"the killed worker's process {sleeper} to be gone")
        assert run not in locks.run_records(), output
        assert netns.list_namespaces(f"rayproof-{run}-") == [], output
    finally:
        if session.poll() is None:
            _stop(session)
        if run in locks.run_records():  # what the sweep did not remove, so this test leaves nothing either
            janitor.clean_run(run)


def test_a_nested_session_is_stopped_when_the_process_that_started_it_dies(tmp_path):
    """A self-test's clause run outliving its killed worker would go on against a platform that is gone."""
    child = f"""
import os, pathlib, signal, threading
from core import processes
signal.signal(signal.SIGTERM, processes.unwind_on_sigterm)
processes.die_with_parent(int(os.environ[processes.DIE_WITH_PARENT_ENV]))
try:
    print("armed", os.getpid(), flush=True)  # inside the try: the parent may be killed the moment this is read
    threading.Event().wait(600)  # a long clause run
except KeyboardInterrupt:
    pathlib.Path({str(tmp_path / "unwound")!r}).write_text("x")
"""
    parent = f"""
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", {child!r}], env={{**os.environ, "{processes.DIE_WITH_PARENT_ENV}": str(os.getpid())}})
sys.stdin.read()
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    starter = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=env)
    nested = None
    try:
        word, pid = starter.stdout.readline().split()
        assert word == "armed"
        nested = int(pid)
        starter.kill()  # as a worker is killed: no cleanup of its own
        starter.wait(timeout=timeouts.PROCESS_EXIT.seconds)
        wait_for(lambda: processes.alive(nested), lambda alive: not alive, timeout=timeouts.PROCESS_EXIT,
                 description=f"the nested process {nested} to stop after its parent died")
        assert (tmp_path / "unwound").exists(), "it was stopped, but did not unwind"
    finally:
        if starter.poll() is None:
            starter.kill()
        if nested is not None and processes.alive(nested):
            os.kill(nested, 9)
