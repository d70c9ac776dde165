"""Running one clause as `rayproof certify` does, and the embedded platforms the self-tests run it on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
import yaml

from clusters.embedded.target import EmbeddedTarget
from fixtures.sharing import host_slot
from rayproof import processes, timeouts
from rayproof.schema import merged
from rayproof.timeouts import Tier

# Each self-test module that starts platforms of its own is one xdist group:
# one worker starts and takes down that module's platforms (their names are
# fixed), beside the workers that run other modules and the clauses on the
# session's platform. How much of this runs at once is set by the machine's
# host slots (fixtures/sharing.py), which every platform start, clause and
# nested clause run here holds, not by the grouping.
def platforms_group(module: str) -> pytest.MarkDecorator:
    """The xdist group of the self-test module ``module`` (its ``__name__``)."""
    return pytest.mark.xdist_group(f"selftest-platforms-{module.rsplit('.', 1)[-1]}")

REPO = Path(__file__).resolve().parents[2]
# How long a self-test's clause run may take to reach its fault. On two
# cores, beside the clauses on the session's platform and the runtime tier,
# the gang of a self-test's training was evicted twice by Kueue's 120 s
# waitForPodsReady before its first checkpoint (TRN-1's self-test, this
# machine, 2026-12-02: the process group formed 15 min after submission), so
# its wait for a checkpoint (training_run, 600 s) ran out before the fault.
# This sets only how long the run may take to get there, never what the
# clause judges; the nested run is one of the suite's own tests, not a
# certification. raycluster_ready is no longer doubled: it was for SEC-1's
# self-test, whose head failed three times in 300 s at load average 24, and
# with host slots that self-test took 41 s (2026-12-03); GCS-2 also judges a
# RayJob's settling by that tier, and its self-test waited out 600 s of it.
NESTED_TRAINING_RUN_S = 2 * timeouts.TRAINING_RUN.seconds
# One clause run, platform start included, on two cores, after waiting for
# its clause's share of the platform and a host slot.
CLAUSE_RUN = Tier("selftest_clause_run", NESTED_TRAINING_RUN_S + 600 + timeouts.CLUSTER_SHARE.seconds,
                  "one clause run in a subprocess")


def run_clause(tmp_path: Path, test: str, *, profile: dict | None = None, platform: str | None = None,
               platform_profile: Path | str | None = None, bounds: dict[Tier, float] | None = None,
               options: Sequence[str] = ()) -> dict[str, Any]:
    """Run one clause (``path::test``) as certify does, with pytest
    ``options`` (certify's own, e.g. ``--upgrade-to``); return its result row.
    ``bounds`` shortens waits the broken platform is known to wait out in full
    (a RayJob that never settles): how long the run looks, never what it judges."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    results = tmp_path / "results.json"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
            "--rootdir", str(REPO), str(REPO / test), "-q", f"--rayproof-results={results}"]
    if profile is not None:
        path = tmp_path / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        argv += ["--profile", str(path)]
    if platform is not None:
        argv += ["--platform-name", platform]
    if platform_profile is not None:
        argv += ["--platform-profile", str(platform_profile)]
    argv += options
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=CLAUSE_RUN.seconds,
                          env={"RAYPROOF_TIMEOUT_TRAINING_RUN": str(NESTED_TRAINING_RUN_S), **os.environ,
                               **{f"{timeouts.OVERRIDE_PREFIX}{t.name.upper()}": f"{s:g}" for t, s in (bounds or {}).items()},
                               processes.DIE_WITH_PARENT_ENV: str(os.getpid())})
    (tmp_path / "run.log").write_text(proc.stdout + proc.stderr)
    assert results.exists(), f"the clause run wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    rows = [r for r in json.loads(results.read_text())["results"] if r["nodeid"].endswith(test.split("::")[-1])]
    assert rows, f"no result for {test}:\n{proc.stdout[-3000:]}"
    # What the run printed (its evidence on failure: objects, events, logs), for a self-test that fails.
    return {**rows[-1], "output": proc.stdout}


def expect_failure(row: dict[str, Any], *causes: str) -> None:
    """The clause failed, and its message names one of ``causes``."""
    output = row.get("output", "")
    assert row["outcome"] == "failed", (f"{row['clause']} {row['outcome']} on a platform that breaks it: "
                                        f"{row['message'][:500]}\n--- the clause run's output, last part:\n{output[-6000:]}")
    assert any(c.lower() in row["message"].lower() for c in causes), (
        f"{row['clause']} failed, but its message does not name the cause ({causes}): {row['message'][:800]}"
        f"\n--- the clause run's output, last part:\n{output[-12000:]}")


def run_platform_profile(config: pytest.Config) -> dict[str, Any]:
    """The fields of the run's ``--platform-profile`` file (none without one)."""
    path = config.getoption("--platform-profile")
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


def misconfigured_platform(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, name: str,
                           profile: dict) -> Iterator[tuple[str, Path]]:
    """An embedded platform started with ``profile`` over the run's own
    platform profile (``--platform-profile``, so ``bin/rayproof test
    --platform-profile real-nodes.yaml`` puts every platform of the run on
    real nodes) over the defaults, or joined, where another session started
    it with the same; taken down by the last session to leave it.

    The session holds one host slot from before the start until it leaves,
    and its nested clause runs inherit it: they run back to back instead of
    each waiting for a slot while the platform's control plane idles beside
    the rest of the run (in the rehearsal before this, the Kueue-unmanaged
    platform stood 20 minutes for three clause runs of about a minute each)."""
    path = tmp_path_factory.mktemp(name) / "platform-profile.yaml"
    path.write_text(yaml.safe_dump(merged(run_platform_profile(config), profile)))
    with host_slot():
        target = EmbeddedTarget.start(name=name, profile=path, progress=print)
        try:
            yield name, path
        finally:
            target.close()  # down when no other session of this machine uses it
