"""`certify` as a user runs it: a subset is PARTIAL, an interrupted run INCOMPLETE.

Each runs `python -m rayproof certify` in a subprocess against the session's
embedded platform (the one the clauses use; certify joins it as a user), as a
user would from a shell, and reads its verdict line and exit status.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from core import processes, timeouts
from core.timeouts import Tier
from core.waiting import wait_for
from fixtures.kube import OWNER_ANNOTATION, TEST_LABEL
from rayproof import cli
from reports import bundle

# Its certify runs sweep ended runs at start: one at a time with the tests
# that play ended runs (tests/test_run_leases.py), which they would remove.
CERTIFY_SWEEPS = pytest.mark.xdist_group("certify-sweeps")
pytestmark = [pytest.mark.slow, CERTIFY_SWEEPS]

REPO = Path(__file__).resolve().parents[1]
# Its clause waits for a host slot as every clause does (up to cluster_share),
# then runs: tier 2 of `bin/rayproof test` saw a 900 s bound end while the
# slots were held by the self-tests beside it.
CERTIFY_RUN = Tier("certify_subset_run", timeouts.CLUSTER_SHARE.seconds + 900,
                   "a certify run of one clause: its wait for a host slot, platform join and teardown included")


def _certify(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "rayproof", "certify", "--out", str(tmp_path / "out"), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,  # Ctrl-C reaches its whole group, never this test's
                            preexec_fn=processes.as_typed_at_a_terminal)  # even where CI ignores SIGINT


def _finish(run: subprocess.Popen, tier: Tier = CERTIFY_RUN) -> str:
    try:
        return run.communicate(timeout=tier.seconds)[0]
    except subprocess.TimeoutExpired as exc:
        seen = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        pytest.fail(f"certify did not end within {tier.name} ({tier.seconds:g} s: {tier.why}); its output, last "
                    f"part:\n{seen[-4000:]}")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


def test_a_subset_is_partial_and_exits_with_the_no_verdict_status(target, tmp_path) -> None:
    run = _certify(tmp_path, "-k", "SEC-1")
    output = _finish(run)
    assert run.returncode == cli.NO_VERDICT_EXIT, output[-4000:]
    certificate = json.loads((tmp_path / "out" / "certification.json").read_text())
    assert certificate["verdict"] == "PARTIAL", certificate["verdict_reason"]
    assert certificate["verdict_reason"].startswith("1 of 17 clauses run"), certificate["verdict_reason"]
    assert "rayproof: PARTIAL — 1 of 17 clauses run" in output, output[-4000:]
    assert (tmp_path / "out" / "certification.md").read_text().startswith("# rayproof certification: PARTIAL")
    archives = list((tmp_path / "out").glob("certification-*.tar.gz"))
    assert len(archives) == 1 and f"evidence bundle {archives[0]}" in output, output[-4000:]
    problems, rebuilt = bundle.verify(archives[0])
    assert problems == [] and rebuilt["verdict"] == "PARTIAL", problems


def test_an_interrupted_run_is_incomplete_and_leaves_nothing(target, kube_api, tmp_path) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    run = _certify(tmp_path, "-k", "OPS-1")

    def its_namespaces() -> list[str]:
        """Namespaces of OPS-1 owned by a process of this certify run (its xdist workers)."""
        if run.poll() is not None:
            return []
        pids = {p.pid for p in psutil.Process(run.pid).children(recursive=True)}
        return [ns.metadata.name for ns in core.list_namespace(label_selector=TEST_LABEL).items
                if ns.metadata.labels[TEST_LABEL].startswith("ops-1-")
                and processes.token_pid((ns.metadata.annotations or {}).get(OWNER_ANNOTATION, "")) in pids]

    try:
        namespaces = wait_for(its_namespaces, lambda names: bool(names) or run.poll() is not None,
                              timeout=timeouts.RAYCLUSTER_READY, interval=1,
                              description="the certify run's OPS-1 namespace, its clause under way")
        assert namespaces, f"certify ended before its clause began:\n{_finish(run)[-4000:]}"
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in the user's terminal
        output = _finish(run)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == cli.NO_VERDICT_EXIT, output[-4000:]
    assert "INCOMPLETE" in output and "CERTIFIED" not in output.replace("NOT CERTIFIED", ""), output[-4000:]
    left = wait_for(lambda: [n.metadata.name for n in core.list_namespace().items if n.metadata.name in namespaces],
                    lambda names: not names, timeout=timeouts.OBJECT_DELETE, interval=2,
                    description=f"the interrupted run's namespaces {namespaces} to be gone")
    assert not left
