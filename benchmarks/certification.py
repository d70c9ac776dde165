"""Where a certification's time and this machine's CPU go.

Run with ``bin/rayproof bench certification [certify options]``. It runs
``rayproof certify`` (the embedded platform by default; any ``certify``
option, such as ``-k`` or ``--kubeconfig``, is passed on) while it reads
every process's CPU time from ``/proc`` every ``SAMPLE_S`` seconds, and
prints:

* the wall time and certify's exit status;
* CPU-seconds used on this machine, by component (control-plane programs,
  the nodes' kubelet, containerd and the rest of the node layer, each kind of
  Ray process, pytest);
* the machine's busy share during the run, and the CPU floor: the busy
  CPU-seconds divided by the cores, the shortest wall time in which this
  machine could do the same work however the clauses were arranged.

On the embedded platform it also prints ``against_node_agent``: the run's
verdict and clause counts, wall time, busy CPU-seconds, and the CPU-seconds
of its node layer and of its pods, beside the same figures of the last
whole certification on the project's node agent before it retired (issue
39: :data:`LAST_NODE_AGENT`), and the run's wall time as a multiple of the
node agent's. (Until then ``--runtimes agent,kubelet`` certified both side
by side in one run.)

Against an existing cluster only the local share is measured (pytest and the
runtime tier's local Ray clusters). A process that lives for less than one
sample interval is missed, and one that ends is counted as of its last sample,
so the figures are a slight undercount; the machine-wide busy share comes from
``/proc/stat`` and misses nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks import machine

REPO = Path(__file__).resolve().parents[1]
SAMPLE_S = 2.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# (substring of a process's program, component); the first match wins. The
# program is what a process runs, not its arguments: a Ray worker's arguments
# name the raylet, and the raylet's name the dashboard agent.
COMPONENTS = [
    ("kube-apiserver", "kube-apiserver"), ("kube-controller-manager", "kube-controller-manager"),
    ("kube-scheduler", "kube-scheduler"), ("/etcd", "etcd"), ("kuberay-operator", "kuberay-operator"),
    ("kueue", "kueue"), ("clusters.embedded.nodes.provisioner", "volume provisioner"),
    ("clusters.embedded.podnet", "pod network"),
    # The nodes: per node kubelet, containerd (its shims apart), kube-proxy, kube-router and the fake GPU
    # plugin; once for all of them the registry and the relay.
    ("/kubelet", "kubelet"), ("containerd-shim", "containerd shims"), ("/containerd", "containerd"),
    ("/kube-proxy", "kube-proxy"), ("/kube-router", "kube-router (NetworkPolicy)"),
    ("/fakegpu", "fake GPU device plugin"), ("/registry", "node image registry"),
    ("clusters.embedded.nodes.relay", "node relay"), ("clusters.embedded.nodes.slowpull", "node registry slow path"),
    ("clusters.embedded.nodes.oomgroup", "node OOM group"), ("/ctr", "node OOM group"),  # and its `ctr events`
    ("redis-server", "redis (GCS fault tolerance)"), ("/gcs_server", "ray: gcs_server"), ("/raylet", "ray: raylet"),
    ("dashboard/agent.py", "ray: dashboard agent"), ("ray::DashboardAgent", "ray: dashboard agent"),
    ("runtime_env/agent", "ray: runtime-env agent"), ("ray::RuntimeEnvAgent", "ray: runtime-env agent"),
    ("dashboard/dashboard.py", "ray: dashboard"), ("ray::Dashboard", "ray: dashboard"),
    ("ray-dashboard-", "ray: dashboard"), ("ray.dashboard.", "ray: dashboard"),  # its modules' processes
    ("log_monitor.py", "ray: log monitor"), ("ray.util.client.server", "ray: client server"),
    ("ray/autoscaler/", "ray: autoscaler monitor"), ("bin/ray start", "ray: `ray start`"),
    ("bin/ray job", "ray: `ray job` (RayJob submitters)"),
    ("ray::RayTrainWorker", "ray: training workers"), ("ray::TrainController", "ray: train controller"),
    ("default_worker.py", "ray: workers not yet started"), ("rayproof bench", "this benchmark"),
    ("workloads/", "ray: job drivers"), (" workloads.", "ray: job drivers"),
    ("pytest", "pytest"), ("sys.stdin.readline()", "pytest"),  # xdist workers: execnet's bootstrap
    ("rayproof certify", "pytest"), ("rayproof test", "pytest"),
]


def program_of(cmdline: str) -> str:
    """What a command line runs: the executable, and for Python the script or
    module (``-m``) with its subcommand (``ray start``, ``rayproof bench``), or
    the code (``-c``); not the options, which name other components."""
    argv = cmdline.split()
    if not argv or "python" not in argv[0].rsplit("/", 1)[-1]:
        return argv[0] if argv else ""
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c"):
        i += 1  # interpreter options such as -u
    if i < len(argv) and argv[i] == "-c":
        return " ".join(argv[:1] + argv[i:])  # the code is the program
    if i < len(argv) and argv[i] == "-m":
        i += 1
    words = argv[i:i + 2]
    return " ".join(argv[:1] + [w for n, w in enumerate(words) if n == 0 or not w.startswith("-")])


def component_of(cmdline: str, name: str) -> str:
    """The component a process belongs to, from what it runs and its process name."""
    program = program_of(cmdline)
    for pattern, component in COMPONENTS:
        if pattern in program or pattern in name:
            return component
    if program.startswith("ray::"):  # any other Ray worker, by what it runs now (ray::IDLE, ray::JobSupervisor...)
        return "ray: " + program.split()[0].split(".")[0].split(":")[2]
    return "python (other)" if "python" in (cmdline.split() or [""])[0] else "other"


# Where a process was started from: its nearest ancestor that is one of these
# (by program), else "elsewhere" (the control plane, the operators, pytest's
# controller). A pod's processes descend from its containerd shim; the runtime
# tier's local Ray clusters and drivers from the xdist workers.
ORIGINS = [("sys.stdin.readline()", "test workers (the runtime tier's local Ray clusters, drivers)"),
           ("containerd-shim", "Kubernetes pods (containerd's shims)")]
ELSEWHERE = "elsewhere (control plane, operators, test processes themselves)"


def origin_root(cmdline: str) -> str | None:
    program = program_of(cmdline)
    return next((origin for pattern, origin in ORIGINS if pattern in program), None)


class ProcessCpu:
    """CPU seconds each process used since the first sample, summed by
    component, and by where the process was started from."""

    def __init__(self, proc: Path = Path("/proc"), classify: Callable[[str, str], str] = component_of) -> None:
        self._proc = proc
        self._classify = classify
        self._baseline: dict[str, float] | None = None  # what processes alive at the start had used
        self._seen: dict[str, tuple[str, float]] = {}  # "pid:starttime" -> (component, cpu seconds)
        self._origin: dict[str, str] = {}  # "pid:starttime" -> origin, fixed when first seen
        self._descendants_of: dict[str, str] = {}  # a root process's key -> the origin of what it starts
        self._key_of_pid: dict[str, str] = {}

    def _place(self, key: str, ppid: str, cmdline: str) -> None:
        """Fix where a newly seen process came from: the origin its parent's
        descendants get (parents are placed first, in order of start time)."""
        parent = self._key_of_pid.get(ppid, "")
        self._origin[key] = self._descendants_of.get(parent) or self._origin.get(parent, ELSEWHERE)
        root = origin_root(cmdline)
        if root is not None:
            self._descendants_of[key] = root

    def sample(self) -> None:
        current = {}
        new: list[tuple[int, str, str, str]] = []  # (start time, key, ppid, cmdline)
        for entry in self._proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                key = f"{entry.name}:{fields[19]}"  # a pid with its start time: pids are reused
                cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
                # Classified at every sample, not once: a Ray worker renames
                # itself (ray::IDLE, ray::RayTrainWorker...) once it has started.
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                component = self._seen[key][0] if not cmdline and key in self._seen else self._classify(cmdline, name)
            except (OSError, ValueError, IndexError):
                continue  # the process ended while being read
            current[key] = (component, cpu_s)
            self._key_of_pid[entry.name] = key
            if key not in self._origin:
                new.append((int(fields[19]), key, fields[1], cmdline))
        for _, key, ppid, cmdline in sorted(new):
            self._place(key, ppid, cmdline)
        self._seen.update(current)
        if self._baseline is None:
            self._baseline = {key: cpu for key, (_, cpu) in current.items()}

    def _used_by(self, label: Callable[[str, str], str]) -> dict[str, float]:
        """CPU seconds used since the first sample, summed by ``label(key, component)``."""
        totals: dict[str, float] = {}
        for key, (component, cpu_s) in self._seen.items():
            name = label(key, component)
            totals[name] = totals.get(name, 0.0) + cpu_s - (self._baseline or {}).get(key, 0.0)
        return {n: round(s, 1) for n, s in sorted(totals.items(), key=lambda kv: -kv[1]) if s >= 0.05}

    def by_component(self) -> dict[str, float]:
        return self._used_by(lambda key, component: component)

    def by_origin(self) -> dict[str, float]:
        return self._used_by(lambda key, component: self._origin.get(key, ELSEWHERE))

    def started_by_component(self) -> dict[str, int]:
        """How many processes of each component were seen that were not running
        at the first sample (what the per-process cost of a component is over)."""
        counts: dict[str, int] = {}
        for key, (component, _) in self._seen.items():
            if key not in (self._baseline or {}):
                counts[component] = counts.get(component, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def cpu_jiffies() -> tuple[int, int]:
    """(busy, idle) clock ticks of the whole machine since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal, idle + iowait


def run(certify_args: list[str]) -> dict:
    processes = ProcessCpu()
    processes.sample()
    busy0, idle0 = cpu_jiffies()
    began = time.monotonic()
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(SAMPLE_S):  # a sampling period, not a wait for anything
            processes.sample()

    thread = threading.Thread(target=sampler, name="cpu-sampler", daemon=True)
    thread.start()
    try:
        rc = subprocess.call([sys.executable, "-m", "rayproof", "certify", *certify_args], cwd=REPO)
    finally:
        stop.set()
        thread.join()
    processes.sample()
    wall = time.monotonic() - began
    busy1, idle1 = cpu_jiffies()
    busy_s = (busy1 - busy0) / CLOCK_TICKS
    idle_s = (idle1 - idle0) / CLOCK_TICKS
    cores = os.cpu_count() or 1
    by_component = processes.by_component()
    return {
        "certify_exit_status": rc,
        "wall_s": round(wall),
        "machine_busy_cpu_s": round(busy_s),
        "machine_busy_share": round(busy_s / (busy_s + idle_s), 2) if busy_s + idle_s else None,
        "cpu_floor_s": round(busy_s / cores),
        "cpu_s_by_component": by_component,
        "cpu_s_processes_counted": round(sum(by_component.values())),
        "processes_started_by_component": processes.started_by_component(),
        "cpu_s_by_origin": processes.by_origin(),
    }


# What runs the nodes: the components that are neither the control plane and
# operators nor Ray, pytest or the pods' own programs.
NODE_LAYER = ("pod network", "volume provisioner", "kubelet", "containerd shims", "containerd",
              "kube-proxy", "kube-router (NetworkPolicy)", "fake GPU device plugin", "node image registry", "node relay",
              "node registry slow path", "node OOM group")
PODS = tuple(origin for _, origin in ORIGINS if origin.startswith("Kubernetes pods"))
# The last whole certification on the project's node agent before it retired
# (issue 39): `bench certification --runtimes agent,kubelet` on 2026-12-05, four
# nodes, the default profile, nothing else running (docs/measurements.md, "Whole
# certifications per node runtime"). Its node layer was the node agent (21.9
# CPU-s) and the pod network (4.5); its pods' processes descended from the agent.
LAST_NODE_AGENT: dict[str, Any] = {
    "measured": "2026-12-05, bench certification --runtimes agent,kubelet, four nodes, default profile",
    "verdict": "CERTIFIED", "counts": {"passed": 16, "not applicable": 1},
    "wall_s": 1354, "machine_busy_cpu_s": 1276, "node_layer_cpu_s": 26.4, "pods_cpu_s": 861.0,
}


def embedded(argv: list[str]) -> bool:
    """Whether certify's options ``argv`` certify the embedded platform (no ``--kubeconfig``)."""
    parser = argparse.ArgumentParser(prog="rayproof bench certification", add_help=False)
    parser.add_argument("--kubeconfig")
    known, _ = parser.parse_known_args(argv)
    return not known.kubeconfig


def out_dir(argv: list[str]) -> Path | None:
    """The directory certify's report goes to (None: certify's default)."""
    parser = argparse.ArgumentParser(prog="rayproof bench certification", add_help=False)
    parser.add_argument("--out")
    known, _ = parser.parse_known_args(argv)
    return Path(known.out) if known.out else None


def outcome(out: Path | None) -> dict[str, Any]:
    """The verdict and clause counts of the certificate certify wrote in ``out``, if it wrote one."""
    certificate = out / "certification.json" if out else None
    if certificate is None or not certificate.is_file():
        return {"verdict": None, "certificate": None}
    summary = json.loads(certificate.read_text())
    return {"verdict": summary.get("verdict"), "verdict_reason": summary.get("verdict_reason"),
            "counts": summary.get("counts"), "certificate": str(certificate)}


def summary(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures of a run to set beside the node agent's last (:data:`LAST_NODE_AGENT`)."""
    components = figures["cpu_s_by_component"]
    return {
        "verdict": figures["outcome"].get("verdict"), "counts": figures["outcome"].get("counts"),
        "wall_s": figures["wall_s"], "machine_busy_cpu_s": figures["machine_busy_cpu_s"],
        "node_layer_cpu_s": round(sum(components.get(c, 0.0) for c in NODE_LAYER), 1),
        "pods_cpu_s": round(sum(figures["cpu_s_by_origin"].get(o, 0.0) for o in PODS), 1),
    }


def against_node_agent(figures: dict[str, Any]) -> dict[str, Any]:
    """This run beside the node agent's last whole certification, and its wall time and busy CPU as
    multiples of the node agent's (issue 39 asks the wall time to come within 1.5 times)."""
    mine = summary(figures)
    return {"node agent (retired; its last figures)": LAST_NODE_AGENT, "this run": mine,
            "wall_s_ratio": round(mine["wall_s"] / LAST_NODE_AGENT["wall_s"], 2),
            "machine_busy_cpu_s_ratio": round(mine["machine_busy_cpu_s"] / LAST_NODE_AGENT["machine_busy_cpu_s"], 2)}


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--runtimes" in argv or any(a.startswith("--runtimes=") for a in argv):
        print("rayproof bench certification: --runtimes is gone with the node agent (issue 39); every run "
              "certifies the nodes' kubelet and prints them against the node agent's last figures", file=sys.stderr)
        return 2
    figures = {**run(argv), "outcome": outcome(out_dir(argv))}
    report: dict[str, Any] = {"benchmark": "certification", "certify_args": argv, "machine": machine(),
                              "figures": figures}
    if embedded(argv):
        report["against_node_agent"] = against_node_agent(figures)
    print(json.dumps(report, indent=2))
    if figures["certify_exit_status"] != 0:
        print(f"rayproof bench: certify exited {figures['certify_exit_status']}; the figures cover a run that did "
              "not certify", file=sys.stderr)
    return int(figures["certify_exit_status"])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
