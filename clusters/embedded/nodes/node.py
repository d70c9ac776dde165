"""One real node: containerd and kubelet in the node's own network and mount namespaces and cgroup tree.

Layout, all under the node's directory ``<run>/nodes/<name>/`` (``NodeDirs``):

* The node's **mount namespace** (made by ``unshare --mount``, private to the
  machine, shared within) binds the node's own directories over ``/run``,
  ``/var/lib`` and ``/var/log``. kubelet's device-plugin socket
  (``/var/lib/kubelet/device-plugins``, a constant), containerd's shim sockets
  (``/run/containerd/s``, a constant), runc's state, CNI's cache
  (``/var/lib/cni``), the pods' network namespaces (``/run/netns/cni-*``) and
  ``/var/log/containers`` therefore land in the node's directory, never in the
  machine's: four nodes on one machine share none of them, as four kind nodes
  do not.
* Six kernel tunables kubelet sets on start (``vm.overcommit_memory=1``,
  ``kernel.panic=10``, ``kernel.panic_on_oops=1`` ...) are machine-wide: the
  node's mount namespace shows kubelet files holding its desired values over
  them, so it changes nothing on the machine (a real node would be changed).
* The **cgroup tree** ``/rayproof-<platform>-<node>`` exists in every cgroup v1
  hierarchy: containerd (and the shims it starts) in ``runtime/``, kubelet in
  ``kubelet/``, kube-proxy in ``kube-proxy/``, the NetworkPolicy engine in ``kube-router/``, the GPU
  device plugin in ``plugins/``, the pods in ``kubepods/`` (kubelet's ``cgroupRoot``). Teardown
  kills every process in the tree, which stops the pods whatever state
  kubelet and containerd were left in.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from clusters.embedded.nodes import slowpull
from clusters.embedded.nodes.fabric import NodeNet
from clusters.embedded.nodes.images import PAUSE_IMAGE
from clusters.embedded.nodes.relay import REGISTRY_PORT, SLOW_PULL_PORT
from clusters.embedded.podnet.network import DNS_IP, DOMAIN, POD_CIDR, SERVICE_CIDR
from core import timeouts
from core.waiting import wait_for

CGROUP_FS = Path("/sys/fs/cgroup")
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"  # inside the node's mount namespace
KUBELET_PORT = 10250
# kubelet's desired values (pkg/kubelet/cm/container_manager_linux.go setupKernelTunables).
KERNEL_TUNABLES = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
                   "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
                   "kernel/keys/root_maxbytes": "25000000"}
# Host paths a node must never write (each is bound over inside the node); checked after teardown.
HOST_PATHS = ("/var/lib/kubelet", "/var/lib/containerd", "/var/lib/cni", "/run/containerd", "/var/log/pods",
              "/var/log/containers")
HOST_PATHS_BEFORE = "host-paths-before.json"  # which of them the machine had before the node started


# kubelet's own default memory.available eviction threshold, kept (``_kubelet_yaml``).
MEMORY_EVICTION_THRESHOLD = "100Mi"


def machine_capacity() -> tuple[int, int]:
    """(CPUs, memory bytes) as kubelet's cAdvisor reads them for every node on this machine."""
    meminfo = Path("/proc/meminfo").read_text()
    kib = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:")))
    return os.cpu_count() or 1, kib * 1024


def system_reserved(shape: Mapping[str, str], cpus: int, memory_bytes: int) -> tuple[dict[str, str], list[str]]:
    """kubelet's ``systemReserved`` that brings a node's allocatable CPU and memory down to the profile's
    node shape, and what the shape asks that this machine cannot give (kubelet reports the machine's own
    CPUs and memory as every node's capacity, and reserves only subtract from it).

    Memory: allocatable = capacity - systemReserved - the eviction threshold, so the threshold is
    counted in. A shape without cpu or memory leaves that resource as kubelet reports it."""
    from kubernetes.utils import parse_quantity

    reserved: dict[str, str] = {}
    short: list[str] = []
    if "cpu" in shape:
        want_m = int(parse_quantity(shape["cpu"]) * 1000)
        if want_m < cpus * 1000:
            reserved["cpu"] = f"{cpus * 1000 - want_m}m"
        elif want_m > cpus * 1000:
            short.append(f"cpu {shape['cpu']}: the machine has {cpus}")
    if "memory" in shape:
        want = int(parse_quantity(shape["memory"]))
        spare = memory_bytes - want - int(parse_quantity(MEMORY_EVICTION_THRESHOLD))
        if spare > 0:
            reserved["memory"] = f"{spare // 2**20}Mi"
        elif want > memory_bytes:
            short.append(f"memory {shape['memory']}: the machine has {memory_bytes / 2**30:.1f}Gi")
    return reserved, short


def v1_hierarchies(*, with_unified: bool = False) -> list[Path]:
    """Mount points of the machine's cgroup v1 hierarchies (controllers and named ones).

    ``with_unified`` adds the cgroup v2 hierarchy a hybrid machine mounts
    beside them (``/sys/fs/cgroup/unified``): nothing is placed there, but
    kubelet and runc (libcontainer's cgroupfs manager) mirror the pods' and
    containers' cgroups into it, so teardown removes those too.
    """
    kinds = ("cgroup", "cgroup2") if with_unified else ("cgroup",)
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] in kinds:
            out.append(Path(fields[1]))
    return sorted(dict.fromkeys(p.resolve() for p in out))


def cgroup_root(platform: str, name: str) -> str:
    return f"/rayproof-{platform}-{name}"


@dataclass(frozen=True)
class Node:
    platform: str
    index: int
    name: str
    dir: Path
    bin_dir: Path  # the platform's built binaries (kubelet, containerd, runc, cni/)

    @property
    def net(self) -> NodeNet:
        return NodeNet(self.platform, self.index)

    @property
    def cgroup(self) -> str:
        return cgroup_root(self.platform, self.name)

    def cgroup_dirs(self, leaf: str = "") -> list[Path]:
        rel = self.cgroup.lstrip("/") + (f"/{leaf}" if leaf else "")
        return [h / rel for h in v1_hierarchies()]

    # -- files ------------------------------------------------------------------------

    def prepare(self, *, ca_file: Path, serving_cert: Path, serving_key: Path, proxy_kubeconfig: Path,
                reserved: Mapping[str, str]) -> None:
        """Write every file the node's programs read, and make its cgroup tree
        (the caller has written kubelet's kubeconfig, ``kubelet.kubeconfig``). ``reserved`` is kubelet's
        ``systemReserved`` (``system_reserved``)."""
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        (d / HOST_PATHS_BEFORE).write_text(json.dumps(host_leaks()))
        for sub in ("run", "var-lib", "var-log", "cni/net.d", "certs.d/_default", f"certs.d/{slowpull.HOST}", "sysctl",
                    "opt"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for key, value in KERNEL_TUNABLES.items():
            (d / "sysctl" / key.replace("/", ".")).write_text(value + "\n")
        (d / "cni/net.d/10-rayproof.conflist").write_text(json.dumps(self.net.cni_config(), indent=1))
        # Every registry name goes to the platform's registry (relay.py), so no lookup leaves the machine.
        # The host of slow pulls goes to the registry's slow path (slowpull.py).
        for host, port in (("_default", REGISTRY_PORT), (slowpull.HOST, SLOW_PULL_PORT)):
            server = f"http://127.0.0.1:{port}"
            (d / "certs.d" / host / "hosts.toml").write_text(
                f'server = "{server}"\n\n[host."{server}"]\n  capabilities = ["pull", "resolve"]\n')
        (d / "containerd.toml").write_text(self._containerd_toml())
        (d / "kubelet.yaml").write_text(self._kubelet_yaml(ca_file, serving_cert, serving_key, reserved))
        (d / "kube-proxy.yaml").write_text(self._kube_proxy_yaml(proxy_kubeconfig))
        (d / "enter.sh").write_text(self._enter_script())
        self._make_cgroups()

    def _containerd_toml(self) -> str:
        b, d = self.bin_dir, self.dir
        return f"""\
# containerd of node {self.name}; paths under /run and /var/lib are the node's own (node.py).
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{d / 'opt'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  # A layer's blob is dropped once unpacked: each node keeps one copy of an image, its snapshots.
  discard_unpacked_layers = true
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{d / 'certs.d'}"

[plugins.'io.containerd.cri.v1.runtime']
  # No CAP_SYS_RESOURCE here: runc could not lower oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "{b / 'runc'}"
      Root = "/run/containerd/runc"
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{b / 'cni'}"]
    conf_dir = "{d / 'cni/net.d'}"

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
"""

    def _kubelet_yaml(self, ca_file: Path, serving_cert: Path, serving_key: Path, reserved: Mapping[str, str]) -> str:
        import yaml

        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This machine mounts cgroup v1; Kubernetes 1.35 refuses it unless told otherwise.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup,
            "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
            "address": self.net.ip,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(ca_file)}},
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(serving_cert),
            "tlsPrivateKeyFile": str(serving_key),
            "clusterDomain": DOMAIN,
            "clusterDNS": [DNS_IP],
            "resolvConf": "",
            "podLogsDir": "/var/log/pods",
            "failSwapOn": False,
            # Every node's nodefs and imagefs is the machine's one disk, shared with the machine's own
            # use: its free space says nothing about a node, so disk pressure neither evicts pods nor
            # collects images (kind's nodes are configured so, for the same reason). Memory pressure
            # keeps kubelet's default threshold.
            "evictionHard": {"memory.available": MEMORY_EVICTION_THRESHOLD, "nodefs.available": "0%", "nodefs.inodesFree": "0%",
                             "imagefs.available": "0%", "imagefs.inodesFree": "0%"},
            "imageGCHighThresholdPercent": 100,
            # The profile's node shape, as far as the machine has it (``system_reserved``): four nodes on
            # one machine would otherwise each offer the scheduler and Kueue all of its memory.
            **({"systemReserved": reserved} if reserved else {}),
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "staticPodPath": "",
        }
        return yaml.safe_dump(cfg, sort_keys=False)

    def _kube_proxy_yaml(self, kubeconfig: Path) -> str:
        import yaml

        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "hostnameOverride": self.name,
            "bindAddress": self.net.ip,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "mode": "iptables",
            "clusterCIDR": POD_CIDR,
            "nodePortAddresses": ["primary"],  # the node's own address, not every local one
            # nf_conntrack_max is machine-wide: 0 leaves it as it is (kube-proxy would raise it).
            "conntrack": {"maxPerCore": 0, "min": 0},
            # No CAP_SYS_RESOURCE here to lower it to kube-proxy's -999.
            "oomScoreAdj": 0,
        }
        return yaml.safe_dump(cfg, sort_keys=False)

    def _enter_script(self) -> str:
        d = self.dir
        binds = [("run", "/run"), ("var-lib", "/var/lib"), ("var-log", "/var/log")]
        lines = [
            "#!/bin/sh",
            f"# Enters node {self.name}: joins a cgroup leaf of its tree ($1), and for containerd (\"mounts\" as $2)",
            "# binds the node's own directories over the machine's; then runs the rest.",
            "set -eu",
            'leaf="$1"; mode="$2"; shift 2',
            f"for h in {' '.join(shlex.quote(str(h)) for h in v1_hierarchies())}; do",
            f'  echo $$ > "$h{self.cgroup}/$leaf/cgroup.procs"',
            "done",
            'if [ "$mode" = mounts ]; then',
        ]
        lines += [f"  mount --bind {shlex.quote(str(d / src))} {dst}" for src, dst in binds]
        lines += [f"  mount --bind {shlex.quote(str(d / 'sysctl' / k.replace('/', '.')))} /proc/sys/{k}"
                  for k in KERNEL_TUNABLES]
        lines += ["  mount --make-rshared /", "fi", 'exec "$@"', ""]
        return "\n".join(lines)

    def _make_cgroups(self) -> None:
        for leaf in ("", "runtime", "kubelet", "kube-proxy", "kube-router", "plugins"):
            for path in self.cgroup_dirs(leaf):
                path.mkdir(exist_ok=True)
                if path.parent.name != "" and (path / "cpuset.cpus").exists():
                    for f in ("cpuset.cpus", "cpuset.mems"):  # empty in a new cpuset: no task may join
                        if not (path / f).read_text().strip():
                            (path / f).write_text((path.parent / f).read_text())

    # -- processes ---------------------------------------------------------------------

    def containerd_argv(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.net.netns}", "unshare", "--mount", "--propagation", "private",
                "/bin/sh", str(self.dir / "enter.sh"), "runtime", "mounts",
                str(self.bin_dir / "containerd"), "--config", str(self.dir / "containerd.toml")]

    def containerd_exec_argvs(self) -> list[list[str]]:
        argv = self.containerd_argv()
        return [argv[3:], argv[6:], argv[10:]]

    def _in_node(self, containerd_pid: int, leaf: str, *program: str) -> list[str]:
        """``program`` in the node's namespaces (containerd's), joining cgroup leaf ``leaf`` of its tree."""
        return ["nsenter", f"--target={containerd_pid}", "--mount", "--net",
                "/bin/sh", str(self.dir / "enter.sh"), leaf, "plain", *program]

    def kubelet_argv(self, containerd_pid: int) -> list[str]:
        return self._in_node(containerd_pid, "kubelet",
                             str(self.bin_dir / "kubelet"), "--config", str(self.dir / "kubelet.yaml"),
                             "--kubeconfig", str(self.dir / "kubelet.kubeconfig"), "--hostname-override", self.name,
                             "--node-ip", self.net.ip, "--node-labels", f"rayproof.dev/node-index={self.index}")

    def kube_proxy_argv(self, containerd_pid: int) -> list[str]:
        """kube-proxy (iptables mode) in the node's namespaces: Services are DNATed in the node."""
        return self._in_node(containerd_pid, "kube-proxy",
                             str(self.bin_dir / "kube-proxy"), "--config", str(self.dir / "kube-proxy.yaml"))

    def kube_router_argv(self, containerd_pid: int) -> list[str]:
        """kube-router's firewall alone, the node's NetworkPolicy engine (``netpol.py``), in its namespaces."""
        return self._in_node(containerd_pid, "kube-router",
                             str(self.bin_dir / "kube-router"), "--kubeconfig", str(self.dir / "kube-router.kubeconfig"),
                             "--hostname-override", self.name,
                             "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
                             "--enable-cni=false", "--enable-ipv4=true", "--enable-ipv6=false",
                             # a pod's traffic is rejected until its own chain is written
                             "--netpol-default-deny=true",
                             f"--service-cluster-ip-range={SERVICE_CIDR}",
                             "--health-port=0", "--metrics-port=0")

    def gpu_plugin_argv(self, containerd_pid: int, count: int) -> list[str]:
        """The fake GPU device plugin (``gomod/kubernetes/fakegpu``), in the node's namespaces."""
        return self._in_node(containerd_pid, "plugins",
                             str(self.bin_dir / "fakegpu"), "--count", str(count), "--id-prefix", f"{self.name}-")

    def oom_group_argv(self, containerd_pid: int, python: str) -> list[str]:
        """The node's ``memory.oom.group`` on cgroup v1 (``oomgroup.py``), in the node's namespaces."""
        return self._in_node(containerd_pid, "plugins",
                             python, "-m", "clusters.embedded.nodes.oomgroup", "--ctr", str(self.bin_dir / "ctr"),
                             "--address", CONTAINERD_SOCKET)

    def ctr(self, containerd_pid: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against this node's containerd (inside its namespaces)."""
        return subprocess.run(["nsenter", f"--target={containerd_pid}", "--mount", "--net",
                               str(self.bin_dir / "ctr"), "--address", CONTAINERD_SOCKET, "-n", "k8s.io", *args],
                              capture_output=True, text=True, timeout=timeout)


def in_node_exec_argvs(argv: list[str]) -> list[list[str]]:
    """The command lines a program started in a node's namespaces (``Node._in_node``) shows once
    ``nsenter`` has exec'd ``enter.sh`` and that has exec'd the program."""
    return [argv[4:], argv[8:]]


# -- teardown ---------------------------------------------------------------------------


def _tree_pids(top: Path) -> set[int]:
    pids: set[int] = set()
    if not top.is_dir():
        return pids
    for procs in top.rglob("cgroup.procs"):
        try:
            pids.update(int(p) for p in procs.read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def kill_tree(cgroup: str) -> int:
    """SIGKILL every process in the cgroup tree ``cgroup`` (all hierarchies) until none is left.

    Freezing first keeps a dying shim from starting anything new while the
    rest is killed. Returns how many processes were killed.
    """
    rel = cgroup.lstrip("/")
    tops = [h / rel for h in v1_hierarchies(with_unified=True)]
    killed: set[int] = set()

    def remaining() -> set[int]:
        left: set[int] = set()
        for top in tops:
            left |= _tree_pids(top)
        for pid in left - killed:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        return left

    wait_for(remaining, lambda left: not left, timeout=timeouts.PROCESS_EXIT, interval=0.2,
             description=f"every process of cgroup tree {cgroup} gone after SIGKILL")
    return len(killed)


def remove_cgroups(cgroup: str) -> None:
    """rmdir the cgroup tree, deepest first, in every hierarchy; safe to repeat."""
    rel = cgroup.lstrip("/")
    for h in v1_hierarchies(with_unified=True):
        top = h / rel
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            path.rmdir()
        top.rmdir()


def host_leaks() -> list[str]:
    """Paths in the machine's own mount namespace that a node should never write, that exist now."""
    leaks = [p for p in HOST_PATHS if os.path.lexists(p)]
    netns = Path("/run/netns")
    if netns.is_dir():
        leaks += [str(p) for p in netns.glob("cni-*")]
    return leaks


def teardown(platform: str, name: str, index: int, node_dir: str) -> None:
    """Stop everything of node ``name`` whatever state it is in, from any process; idempotent.

    For ``EmbeddedPlatform.register_cleanup``: runs after the platform's
    processes (kubelet, containerd) were stopped. Kills what is left in the
    node's cgroup tree (the shims and the pods' processes), removes the tree
    and the node's network namespace. The node's mount namespace, and with it
    every mount containerd and kubelet made (pods' network namespaces, image
    snapshots, volumes), ends with its last process.
    """
    cgroup = cgroup_root(platform, name)
    kill_tree(cgroup)
    # rmdir answers EBUSY for a moment after a cgroup's last task has exited.
    wait_for(lambda: remove_cgroups(cgroup) or True, timeout=timeouts.PROCESS_EXIT, interval=0.1,
             ignore=(OSError,), description=f"cgroup tree {cgroup} removed once empty")
    NodeNet(platform, index).delete()
    try:
        before = set(json.loads((Path(node_dir) / HOST_PATHS_BEFORE).read_text()))
    except FileNotFoundError:  # never prepared: it ran nothing
        before = set(host_leaks())
    leaks = sorted(set(host_leaks()) - before)
    if leaks:
        raise RuntimeError(f"node {name} wrote into the machine's own paths: {', '.join(leaks)}; remove them "
                           "(after checking no containerd or kubelet runs) and report it as a bug")


def env_for(kind: str) -> Mapping[str, str]:
    """Environment of a node program: a plain PATH (kubelet and containerd look up mount, iptables, nsenter)."""
    extra = {"containerd": {"GOTRACEBACK": "all"},
             # distribution exports OpenTelemetry traces to localhost:4318 unless told not to.
             "registry": {"OTEL_TRACES_EXPORTER": "none"}}.get(kind, {})
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
            "LANG": "C.UTF-8", **extra}
