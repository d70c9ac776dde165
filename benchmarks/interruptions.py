"""What interrupted certifications leave behind.

Run with ``bin/rayproof bench interruptions [--runs N] [--seed S] [-k EXPR]``
on the embedded platform. It starts ``rayproof certify -k EXPR`` ``N`` times
(default 20) and interrupts each at a random point, cycling through the ways
a run ends early:

* ``sigint``: Ctrl-C, SIGINT to the runner's process group;
* ``sigterm``: SIGTERM to the runner (a CI timeout, ``kill``);
* ``sigkill``: SIGKILL of the runner (its workers are left to themselves);
* ``worker``: SIGKILL of one pytest-xdist worker.

After each, it does what the next run does when it starts (waits until the
interrupted run's lease has expired, so it can be judged ended from any host,
and sweeps as ``certify`` does at start), then counts what is left that was
not there before the run: namespaces with the run label, processes the run
started, network namespaces, cgroups and mounts of the suite's, and
cluster-share locks still held. Every figure should be zero.

The platform is brought up once, as ``bin/rayproof up`` does, and left
running (a run never takes down a platform it did not bring up).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

import benchmarks
from benchmarks import machine
from core import processes, timeouts
from core.timeouts import Tier
from core.waiting import WaitTimeout, wait_for

REPO = Path(__file__).resolve().parents[1]
MODES = ("sigint", "sigterm", "sigkill", "worker")
RUN_TO_END = Tier("certify_to_end", 1800, "a certify run that lost an xdist worker finishes its other clauses")


def _held_locks() -> list[str]:
    """Cluster-share lock files some process still holds."""
    from core.locks import runtime_dir

    held = []
    for path in sorted((runtime_dir() / "cluster-shares").rglob("*")):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(str(path))
        finally:
            os.close(fd)
    return held


def _interrupt(proc: subprocess.Popen, mode: str) -> str:
    """Interrupt a certify run as ``mode`` says; what was signalled."""
    if mode == "sigint":
        os.killpg(proc.pid, signal.SIGINT)
        return f"SIGINT to process group {proc.pid}"
    if mode == "sigterm":
        proc.send_signal(signal.SIGTERM)
        return f"SIGTERM to runner {proc.pid}"
    if mode == "sigkill":
        proc.kill()
        return f"SIGKILL to runner {proc.pid}"
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "execnet" in " ".join(p.cmdline())
               or "sys.stdin.readline()" in " ".join(p.cmdline())]
    if not workers:
        proc.kill()
        return f"no xdist worker yet: SIGKILL to runner {proc.pid}"
    workers[0].kill()
    return f"SIGKILL to xdist worker {workers[0].pid}"


def one_run(index: int, mode: str, at_s: float, k: str, out: Path, api: Any) -> dict[str, Any]:
    from fixtures import janitor, leases

    before = benchmarks.host_leftovers()
    log = open(out / f"run-{index}.log", "w")
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "rayproof", "certify", "-k", k, "--out", str(out / f"run-{index}")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=processes.as_typed_at_a_terminal)
    started: dict[int, float] = {}
    try:
        wait_for(lambda: proc.poll() is not None or time.monotonic() - began >= at_s, timeout=Tier(
            "interruption_point", at_s + 30, "the random point at which the bench interrupts certify"),
            description=f"run {index}: {at_s:.0f} s into certify (or its end)")
        if proc.poll() is None:
            started = {p.pid: processes.started_since_boot(p.pid) for p in psutil.Process(proc.pid).children(recursive=True)}
        what = _interrupt(proc, mode) if proc.poll() is None else f"ended by itself (exit {proc.returncode})"
        # A run that lost one worker goes on with the others (xdist reports the crash) to its end.
        wait_for(proc.poll, lambda rc: rc is not None,
                 timeout=RUN_TO_END if mode == "worker" else timeouts.PYTEST_SESSION,
                 description=f"run {index}: the runner to exit after {what}")
        try:
            gone = wait_for(lambda: [pid for pid, t in started.items() if _same(pid, t)], lambda left: not left,
                            timeout=timeouts.PYTEST_SESSION, ignore=(),
                            description=f"run {index}: the processes certify started to exit")
        except WaitTimeout as exc:
            gone = list(exc.last_value or [])  # left behind: counted, then stopped below
    finally:
        for pid, created in started.items():  # the processes this bench started, by PID
            if _same(pid, created):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    interrupted_s = time.monotonic() - began
    # The next run's start: once every ended run's lease has expired, sweep as certify does.
    wait_for(lambda: [s.run_id for s in leases.run_states(api).values() if s.live], lambda live: not live,
             timeout=Tier("lease_expiry", leases.LEASE_DURATION_S + leases.CLOCK_SKEW_S + 60,
                          "an ended run's lease expires"),
             interval=2, description=f"run {index}: the interrupted run's lease to expire")
    swept = janitor.clean_on_cluster(api, janitor.orphaned_on_cluster(api))
    namespaces = wait_for(lambda: _suite_namespaces(api), lambda left: not left, timeout=timeouts.OBJECT_DELETE,
                          interval=2, ignore=(), description=f"run {index}: swept namespaces to be gone") \
        if swept else _suite_namespaces(api)
    after = benchmarks.host_leftovers()
    return {"run": index, "mode": mode, "interrupted_at_s": round(at_s, 1), "signalled": what,
            "exit_status": proc.returncode, "seconds_to_exit": round(interrupted_s - at_s, 1),
            "swept_at_next_start": swept,
            "left": {"namespaces": namespaces, "processes": gone,
                     **{kind: sorted(after[kind] - before[kind]) for kind in after}, "held locks": _held_locks()}}


def _same(pid: int, created: float) -> bool:
    try:
        p = psutil.Process(pid)
        return processes.started_since_boot(p.pid) == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _suite_namespaces(api: Any) -> list[str]:
    from kubernetes import client

    from fixtures.leases import RUN_LABEL

    return sorted(n.metadata.name for n in client.CoreV1Api(api).list_namespace(label_selector=RUN_LABEL).items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayproof bench interruptions", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="of the random interruption points (printed)")
    parser.add_argument("-k", default="ADM-1 or OPS-1 or GCS-1", help="the clauses each certify runs")
    parser.add_argument("--earliest", type=float, default=5.0, help="earliest interruption point, seconds")
    parser.add_argument("--latest", type=float, default=150.0, help="latest interruption point, seconds")
    args = parser.parse_args(argv)
    from clusters.embedded.platform import EmbeddedPlatform

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"rayproof-bench-interruptions-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    platform = EmbeddedPlatform("default", progress=lambda m: print(f"rayproof bench: {m}", file=sys.stderr))
    platform.up()  # as `bin/rayproof up`: left running, never taken down by a run
    api = platform.api_client()
    rows = []
    interrupted = False
    try:
        for index in range(args.runs):
            mode = MODES[index % len(MODES)]
            at_s = rng.uniform(args.earliest, args.latest)
            row = one_run(index, mode, at_s, args.k, out, api)
            left = {kind: len(items) for kind, items in row["left"].items()}
            print(f"rayproof bench: run {index} {mode} at {at_s:.0f} s: exit {row['exit_status']}, "
                  f"swept {len(row['swept_at_next_start'])}, left {left}", file=sys.stderr, flush=True)
            rows.append(row)
    except KeyboardInterrupt:  # the figures of the runs that finished are kept, not lost in a traceback
        interrupted = True
        print(f"rayproof bench: interrupted during run {len(rows)}; the figures below are of the {len(rows)} runs "
              f"that finished. `bin/rayproof clean` removes what the interrupted one left; the platform stays up "
              f"(`bin/rayproof down` takes it down)", file=sys.stderr, flush=True)
    totals = {kind: sum(len(r["left"][kind]) for r in rows) for kind in rows[0]["left"]} if rows else {}
    print(json.dumps({"benchmark": "interruptions", "seed": seed, "runs": args.runs, "runs_finished": len(rows),
                      "clauses": args.k, "machine": machine(), "left_after_next_start": totals, "rows": rows},
                     indent=2))
    return 130 if interrupted else 1 if any(totals.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
