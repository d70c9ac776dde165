"""Training figures on a local 3-node Ray cluster: step time, checkpoint save and restore, restart latency.

Run with ``bin/rayproof bench training``.  Starts the same cluster shape as
the WL-TRN clauses (a head without CPUs, two 1-CPU workers, one rank each),
trains the test model, kills one worker node mid-run, adds a replacement and
reports what it measured.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import machine
from core import timeouts
from fixtures.local_ray import LocalRayCluster
from fixtures.local_training import lost_work, start_training

STEPS = 40
CHECKPOINT_EVERY = 5


def run(workdir: Path) -> dict:
    figures: dict = {}
    began = time.monotonic()
    with LocalRayCluster(workdir=workdir, head_cpus=0) as cluster:
        cluster.add_workers(2)
        figures["cluster_start_s"] = round(time.monotonic() - began, 1)
        run = start_training(cluster, "bench", "bench.log", steps=STEPS, checkpoint_every=CHECKPOINT_EVERY,
                             timeout_s=60, max_failures=2)
        run.log.wait_for("step", lambda e: e["step"] >= 2 * CHECKPOINT_EVERY + 2, timeout=timeouts.TRAINING_RUN,
                         description="training to pass step 12")
        killed_at = time.time()
        cluster.kill_node(cluster.workers[-1])
        cluster.add_worker(cpus=1)
        rc = run.wait_exit()
        events = run.log.events()
    if rc != 0:
        raise SystemExit(f"benchmark training run failed (exit {rc}); see bench.log in {workdir}")
    steps = [e for e in events if e["event"] == "step"]
    lost = lost_work(events)
    intervals = [b["ts"] - a["ts"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1
                 and b["ts"] - a["ts"] < 5]
    saves = [e["seconds"] for e in events if e["event"] == "checkpoint_saved"]
    restores = [e["seconds"] for e in events if e["event"] == "checkpoint_restored"]
    first_after = next(e for e in steps if e["ts"] > lost["restore_ts"])
    figures.update({
        "step_time_median_s": round(statistics.median(intervals), 3),
        "step_time_p90_s": round(sorted(intervals)[int(0.9 * (len(intervals) - 1))], 3),
        "checkpoint_save_median_s": round(statistics.median(saves), 3),
        "checkpoint_restore_s": restores,
        "kill_to_restored_s": round(lost["restore_ts"] - killed_at, 2),
        "kill_to_first_step_s": round(first_after["ts"] - killed_at, 2),
        "steps_lost": lost["steps_lost"],
    })
    return figures


def main(argv: list[str] | None = None) -> int:
    if argv:
        raise SystemExit(f"rayproof bench training takes no options (got {' '.join(argv)})")
    with tempfile.TemporaryDirectory(prefix="rayproof-bench-") as tmp:
        figures = run(Path(tmp) / "cluster")
    print(json.dumps({"benchmark": "training", "machine": machine(), "figures": figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
