"""Where a certification's time and this machine's CPU go.

Run with ``bin/rayproof bench certification [certify options]``. It runs
``rayproof certify`` (the embedded platform by default; any ``certify``
option, such as ``-k`` or ``--kubeconfig``, is passed on) while it reads
every process's CPU time from ``/proc`` every ``SAMPLE_S`` seconds, and
prints:

* the wall time and certify's exit status;
* CPU-seconds used on this machine, by component (control-plane programs,
  the node agent, each kind of Ray process, pytest);
* the machine's busy share during the run, and the CPU floor: the busy
  CPU-seconds divided by the cores, the shortest wall time in which this
  machine could do the same work however the clauses were arranged.

With ``--runtimes agent,kubelet`` it certifies the embedded platform once per
node runtime, one after the other in the same run (each on its own platform,
``bench-cert-<runtime>``, with the given ``--platform-profile``'s settings
and ``nodes.runtime`` set; reports under ``--out``/<runtime>), and prints
``side_by_side``: each run's verdict and clause counts, wall time, busy
CPU-seconds, and the CPU-seconds of its node layer and of its pods.

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
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml

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
    ("kueue", "kueue"), ("clusters.embedded.nodeagent.provisioner", "volume provisioner"),
    ("clusters.embedded.nodeagent", "node agent"), ("clusters.embedded.podnet", "pod network"),
    # The real nodes (nodes.runtime: kubelet): per node kubelet, containerd (its shims apart), kube-proxy,
    # kube-router and the fake GPU plugin; once for all of them the registry and the relay.
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
# controller). A pod's processes descend from the node agent; the runtime
# tier's local Ray clusters and drivers from the xdist workers.
ORIGINS = [("clusters.embedded.nodeagent run", "Kubernetes pods (node agent)"),
           ("sys.stdin.readline()", "test workers (the runtime tier's local Ray clusters, drivers)"),
           ("containerd-shim", "Kubernetes pods (real nodes: containerd's shims)")]
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


RUNTIMES = ("agent", "kubelet")
# What runs the nodes, for either runtime: the components that are neither the
# control plane and operators nor Ray, pytest or the pods' own programs.
NODE_LAYER = ("node agent", "pod network", "volume provisioner", "kubelet", "containerd shims", "containerd",
              "kube-proxy", "kube-router (NetworkPolicy)", "fake GPU device plugin", "node image registry", "node relay",
              "node registry slow path", "node OOM group")
PODS = tuple(origin for _, origin in ORIGINS if origin.startswith("Kubernetes pods"))


def runtime_runs(argv: list[str], workdir: Path) -> tuple[list[str], dict[str, tuple[list[str], Path | None]]]:
    """Parse ``--runtimes`` out of the benchmark's options: the runtimes (empty:
    one plain certify run of ``argv``), and per runtime certify's options for a
    run of its own platform with ``nodes.runtime`` set over the given profile,
    with the directory its report goes to (None: certify's default)."""
    parser = argparse.ArgumentParser(prog="rayproof bench certification", add_help=False)
    parser.add_argument("--runtimes", default="")
    for option in ("--platform-profile", "--platform-name", "--out", "--kubeconfig"):
        parser.add_argument(option)
    known, rest = parser.parse_known_args(argv)
    if not known.runtimes:
        return [], {"": (list(argv), Path(known.out) if known.out else None)}
    runtimes = [r.strip() for r in known.runtimes.split(",") if r.strip()]
    unknown = sorted(set(runtimes) - set(RUNTIMES))
    if unknown or len(set(runtimes)) != len(runtimes):
        raise ValueError(f"--runtimes {known.runtimes!r}: name each of {', '.join(RUNTIMES)} at most once")
    if known.kubeconfig or known.platform_name:
        raise ValueError("--runtimes certifies embedded platforms of its own (bench-cert-<runtime>); it takes "
                         "no --kubeconfig or --platform-name")
    base: dict[str, Any] = {}
    if known.platform_profile:
        base = yaml.safe_load(Path(known.platform_profile).read_text()) or {}
        if not isinstance(base, dict):
            raise ValueError(f"--platform-profile {known.platform_profile}: not a mapping")
    out = Path(known.out) if known.out else workdir
    runs = {}
    for runtime in runtimes:
        profile = {**base, "nodes": {**(base.get("nodes") or {}), "runtime": runtime}}
        path = workdir / f"platform-profile-{runtime}.yaml"
        path.write_text(yaml.safe_dump(profile, sort_keys=False))
        runs[runtime] = ([*rest, "--platform-name", f"bench-cert-{runtime}", "--platform-profile", str(path),
                          "--out", str(out / runtime)], out / runtime)
    return runtimes, runs


def outcome(out: Path | None) -> dict[str, Any]:
    """The verdict and clause counts of the certificate certify wrote in ``out``, if it wrote one."""
    certificate = out / "certification.json" if out else None
    if certificate is None or not certificate.is_file():
        return {"verdict": None, "certificate": None}
    summary = json.loads(certificate.read_text())
    return {"verdict": summary.get("verdict"), "verdict_reason": summary.get("verdict_reason"),
            "counts": summary.get("counts"), "certificate": str(certificate)}


def side_by_side(figures: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per runtime, the figures to set side by side."""
    rows = {}
    for runtime, f in figures.items():
        components = f["cpu_s_by_component"]
        rows[runtime] = {
            "verdict": f["outcome"].get("verdict"), "counts": f["outcome"].get("counts"),
            "wall_s": f["wall_s"], "machine_busy_cpu_s": f["machine_busy_cpu_s"],
            "node_layer_cpu_s": round(sum(components.get(c, 0.0) for c in NODE_LAYER), 1),
            "pods_cpu_s": round(sum(f["cpu_s_by_origin"].get(o, 0.0) for o in PODS), 1),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    with tempfile.TemporaryDirectory(prefix="rayproof-bench-cert-") as tmp:
        try:
            runtimes, runs = runtime_runs(argv, Path(tmp))
        except (ValueError, OSError, yaml.YAMLError) as exc:
            print(f"rayproof bench certification: {exc}", file=sys.stderr)
            return 2
        figures = {}
        for runtime, (certify_args, out) in runs.items():
            if runtime:
                print(f"rayproof bench: certifying on nodes.runtime {runtime}: rayproof certify "
                      f"{' '.join(certify_args)}", file=sys.stderr, flush=True)
            figures[runtime] = {**run(certify_args), "outcome": outcome(out)}
    report: dict[str, Any] = {"benchmark": "certification", "certify_args": argv, "machine": machine()}
    if runtimes:
        report.update(runtimes=figures, side_by_side=side_by_side(figures))
    else:
        report["figures"] = figures[""]
    print(json.dumps(report, indent=2))
    failed = {runtime or "certify": f["certify_exit_status"] for runtime, f in figures.items()
              if f["certify_exit_status"] != 0}
    if failed:
        print(f"rayproof bench: certify exited {failed}; the figures cover a run that did not certify",
              file=sys.stderr)
    return next(iter(failed.values()), 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
