"""What the embedded platform's node layer costs: warm ``up``, idle CPU and memory, ``down``.

Run with ``bin/rayproof bench nodes [--runs N] [--idle-s S]``. It brings up
a platform of its own (``bench-nodes``, never ``default``) ``N`` times
(default 3), and for each run prints:

* ``up_s``: the wall time of a warm ``up`` (binaries already built; a build,
  if one was needed, happens once before the runs and is printed apart;
  the nodes' pre-pull of the Ray image, ``nodes.prepullImages``, is left
  out, so the pull is measured on its own below);
* the CPU-seconds every platform process (with what it started) used while
  the platform sat idle for ``S`` seconds (default 60), as a share of one
  core, and the node layer's sum (kubelet, containerd, kube-proxy and
  kube-router of every node, the registry, the relay and the pod network);
* their resident memory (with what they started) at the end of that window;
* ``down_s``, and what ``down`` left on this machine that the suite makes
  (network namespaces, cgroups, mounts): every count should be zero;
* ``ray_image``: what building the Ray image took (once
  per version, from its record), then, after the idle window, every node
  pulling it at once: kubelet's pull time per node, the wall time until each
  ran a pod of it, the disk each node's containerd holds, and the disk all
  of them hold together, before and after the nodes' unpacked copies are
  shared (``nodes/sharedlayers.py``, as ``up`` does after its pre-pull).

``side_by_side`` gives the median of those figures beside the project's
node agent's, measured the same way before it retired (issue 39:
:data:`LAST_NODE_AGENT`), and ``node_layer_build_s`` the seconds each
node-layer binary took when the platform's binaries were built (from the
build's record, so also when they were cached: what a cold build adds for
the nodes, less what a warm Go build cache saved it then).

It asserts nothing about time. Other work on the machine shows in the
figures: run it on a quiet machine and read ``machine.load_average``.
Interrupted (Ctrl-C), it takes its platform down, prints the figures of the
runs that finished and exits 130.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import psutil

import benchmarks
from benchmarks import machine
from chaos.straggler import pull_seconds

PLATFORM_NAME = "bench-nodes"
DESCRIPTION = ("upstream kubelet, containerd, runc, kube-proxy and kube-router per node; CoreDNS pods; the pod "
               "network's router (Python)")
# The project's node agent (one Python process for every node, with the pod
# network's DNS, Service rules and node ports), retired in issue 39: its
# medians of SIDE_BY_SIDE in its last `bench nodes` (2026-12-04, 3 runs, 60 s
# windows, four nodes, nothing else running), to set the nodes' beside.
LAST_NODE_AGENT: dict[str, Any] = {
    "measured": "2026-12-04, bench nodes, 3 runs, 60 s idle windows, four nodes, medians",
    "up_s": 19.9, "idle_core_share_node_layer": 0.004, "idle_cpu_s_platform": 3.4, "rss_mib_node_layer": 128,
    "down_s": 13.6,
}
NODE_AGENT_COLUMN = "node agent (retired; its last figures)"
NODES_COLUMN = "kubelet"


def node_layer(names: Iterable[str]) -> list[str]:
    """Which of the platform's processes are its node layer."""
    from clusters.embedded.nodes.layer import PER_NODE_KINDS, POLICY_ENGINE_KIND

    return [n for n in names if n in ("podnet", "relay", "registry")
            or n.rsplit("-", 1)[0] in (*PER_NODE_KINDS, POLICY_ENGINE_KIND)]


def _tree_sum(pids: dict[str, int], measure: Callable[[psutil.Process], float]) -> dict[str, float]:
    """``measure`` summed over each named process and its live descendants;
    a process that is gone counts as nothing."""
    out = {}
    for name, pid in pids.items():
        total = 0.0
        try:
            root = psutil.Process(pid)
            for proc in (root, *root.children(recursive=True)):
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += measure(proc)
        except psutil.NoSuchProcess:
            pass
        out[name] = total
    return out


def tree_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU-seconds each named process and its live descendants have used so far."""
    return _tree_sum(pids, lambda proc: proc.cpu_times().user + proc.cpu_times().system)


def tree_rss_mib(pids: dict[str, int]) -> dict[str, int]:
    """Resident memory of each named process and its live descendants, MiB."""
    return {name: round(b / 2**20) for name, b in _tree_sum(pids, lambda proc: proc.memory_info().rss).items()}


def idle_cpu(pids: dict[str, int], idle_s: float) -> dict[str, float]:
    """CPU-seconds each process tree used over an ``idle_s`` window."""
    before = tree_cpu_s(pids)
    threading.Event().wait(idle_s)  # the measuring window itself, not a wait for anything
    after = tree_cpu_s(pids)
    return {name: round(max(0.0, after[name] - before[name]), 2) for name in pids}


def summarize(cpu_s: dict[str, float], idle_s: float, node_layer: Iterable[str]) -> dict[str, Any]:
    layer = [name for name in node_layer if name in cpu_s]
    layer_s = sum(cpu_s[name] for name in layer)
    return {
        "idle_window_s": idle_s,
        "idle_cpu_s_by_process": dict(sorted(cpu_s.items(), key=lambda kv: -kv[1])),
        "idle_cpu_s_platform": round(sum(cpu_s.values()), 2),
        "node_layer": layer,
        "idle_cpu_s_node_layer": round(layer_s, 2),
        "idle_core_share_node_layer": round(layer_s / idle_s, 3) if idle_s else None,
    }


def ray_image_first_pull(platform: Any) -> dict[str, Any]:
    """Every node pulls the Ray image at once (a pod each, which runs ``true``): kubelet's pull
    time per node, the wall time until every pod ran, and the disk each node's containerd holds then."""
    import subprocess

    from kubernetes import client

    from clusters.embedded.nodes import images, layer, rayimage
    from core import timeouts
    from core.waiting import wait_for

    core = client.CoreV1Api(platform.api_client())
    namespace = "bench-ray-image"
    core.create_namespace({"metadata": {"name": namespace}})
    nodes = layer.nodes_of(platform)
    began = time.monotonic()
    for node in nodes:
        core.create_namespaced_pod(namespace, {"metadata": {"name": node.name}, "spec": {
            "nodeName": node.name, "restartPolicy": "Never",
            "containers": [{"name": "main", "image": rayimage.image_name(), "command": ["true"]}]}})
    for node in nodes:
        wait_for(lambda n=node.name: core.read_namespaced_pod(n, namespace).status.phase,
                 lambda phase: phase == "Succeeded", timeout=timeouts.IMAGE_PULL,
                 description=f"node {node.name} to pull the Ray image and run a pod of it")
    wall_s = time.monotonic() - began
    pulled = {}
    for event in core.list_namespaced_event(namespace).items:
        seconds = pull_seconds(event.message or "") if event.reason == "Pulled" else None
        if seconds is not None:
            pulled[event.involved_object.name] = seconds

    def disk_gib(*paths: Path) -> float:
        """What the paths hold together (du counts a file linked from several of them once)."""
        out = subprocess.run(["du", "-s", "-c", "--block-size=1", *map(str, paths)], capture_output=True, text=True,
                             check=True)
        return round(int(out.stdout.splitlines()[-1].split()[0]) / 2**30, 2)

    stores = [n.dir / "var-lib" / "containerd" for n in nodes]
    unshared = disk_gib(*stores)
    began = time.monotonic()
    print(f"{platform.name}: {layer.share_image_layers(platform).summary()}", flush=True)
    return {"image": rayimage.image_name(), "build": rayimage.last_build(images.cache_dir()),
            "pull_s_by_node": dict(sorted(pulled.items())), "all_nodes_pulled_wall_s": round(wall_s, 1),
            "containerd_disk_gib_by_node": {n.name: disk_gib(store) for n, store in zip(nodes, stores)},
            "containerd_disk_gib_all_nodes": {"each_its_own_copy": unshared, "layers_shared": disk_gib(*stores)},
            "share_layers_s": round(time.monotonic() - began, 1)}


def one_run(platform: Any, idle_s: float) -> dict[str, Any]:
    before = benchmarks.host_leftovers()
    began = time.monotonic()
    try:  # down also after an up that failed or was interrupted (up keeps its run directory then)
        platform.up()
        up_s = time.monotonic() - began
        pids = {rec.name: rec.pid for rec in platform.supervisor.records() if rec.identity_ok()}
        layer = node_layer(pids)
        row: dict[str, Any] = {"up_s": round(up_s, 1), **summarize(idle_cpu(pids, idle_s), idle_s, layer)}
        rss = tree_rss_mib(pids)
        row["rss_mib_by_process"] = dict(sorted(rss.items()))
        row["rss_mib_node_layer"] = sum(mib for name, mib in rss.items() if name in layer)
        row["ray_image"] = ray_image_first_pull(platform)  # after the idle window, so that up and idle leave it out
    finally:
        began = time.monotonic()
        platform.down()
        down_s = time.monotonic() - began
    left = {kind: sorted(items - before[kind]) for kind, items in benchmarks.host_leftovers().items()}
    return {**row, "down_s": round(down_s, 1), "left_after_down": left}


SIDE_BY_SIDE = ("up_s", "idle_core_share_node_layer", "idle_cpu_s_platform", "rss_mib_node_layer", "down_s")


def side_by_side(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each figure of ``SIDE_BY_SIDE``: the node agent's last median beside the median of the finished ``runs``."""
    out: dict[str, dict[str, float | None]] = {}
    for figure in SIDE_BY_SIDE:
        values = [row[figure] for row in runs if row.get(figure) is not None]
        out[figure] = {NODE_AGENT_COLUMN: LAST_NODE_AGENT[figure],
                       NODES_COLUMN: statistics.median(values) if values else None}
    return out


def node_layer_build_s(binaries: dict[str, Any]) -> dict[str, float]:
    """Seconds each node-layer binary took in the build that made ``binaries`` (its record)."""
    from clusters.embedded import build

    if "kubelet" not in binaries:
        return {}
    seconds = build.build_info(Path(binaries["kubelet"]).parent).get("seconds", {})
    mine = {k: v for k, v in seconds.items() if not k.endswith(":modules") and (
        k in ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "runc", "pause", "fakegpu",
              "registry", "kube-router")
        or k.startswith("cni/"))}
    return {**mine, "total": round(sum(mine.values()), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayproof bench nodes", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=60.0, help="the idle window measured in each run")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.idle_s <= 0:
        parser.error("--runs must be at least 1 and --idle-s above 0")
    from clusters.embedded.platform import EmbeddedPlatform

    def say(message: str) -> None:
        print(f"rayproof bench: {message}", file=sys.stderr, flush=True)

    platform = EmbeddedPlatform(PLATFORM_NAME, profile={"nodes": {"prepullImages": []}}, progress=say)
    platform.down()  # a bench interrupted earlier left its platform: start from nothing
    began = time.monotonic()
    binaries = platform.binaries()  # builds what the pinned versions need, once, outside the timed runs
    build_s = round(time.monotonic() - began, 1)
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        for index in range(args.runs):
            row = one_run(platform, args.idle_s)
            say(f"run {index}: up {row['up_s']} s, node layer idle "
                f"{row['idle_core_share_node_layer']:.1%} of a core, down {row['down_s']} s")
            rows.append(row)
    except KeyboardInterrupt:  # the platform is down (one_run's finally); keep the finished runs' figures
        interrupted = True
        say("interrupted; the figures below are of the runs that finished")
    left = sum(len(items) for row in rows for items in row["left_after_down"].values())
    print(json.dumps({"benchmark": "nodes", "machine": machine(), "build_s": build_s,
                      "node_layer_build_s": node_layer_build_s(binaries), "side_by_side": side_by_side(rows),
                      "node_agent_measured": LAST_NODE_AGENT["measured"], "node_layer": DESCRIPTION,
                      "runs_finished": len(rows), "runs": rows}, indent=2))
    return 130 if interrupted else 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
