"""Build the embedded platform's upstream programs from published Go modules.

Every program comes from a module served by the Go module proxy, pinned in
``versions.toml`` beside this file; nothing is built from a git checkout and no
upstream code is copied into the repository:

* ``kube-apiserver``, ``kube-controller-manager``, ``kube-scheduler``,
  ``kubectl`` (for users of the platform, not run by it), and the node
  layer's ``kubelet`` and ``kube-proxy`` from ``k8s.io/kubernetes`` (a
  generated consumer module that requires it and replaces every
  ``k8s.io/<staging>`` module with its published ``v0.Y.Z``);
* ``etcd`` from a tiny generated ``main`` that calls ``etcdmain.Main``;
* ``kuberay-operator`` from ``github.com/ray-project/kuberay/ray-operator``;
* ``kueue`` from ``sigs.k8s.io/kueue/cmd/kueue``;
* the node layer: ``containerd``, ``containerd-shim-runc-v2`` and ``ctr``
  from ``github.com/containerd/containerd/v2``; ``runc`` (cgo, seccomp) from
  ``github.com/opencontainers/runc``; the CNI plugins ``ptp``,
  ``loopback``, ``host-local`` and ``portmap`` from
  ``github.com/containernetworking/plugins`` into ``cni/``; ``registry``
  from ``github.com/distribution/distribution/v3``; ``kube-router`` (the
  nodes' NetworkPolicy engine) from ``github.com/cloudnativelabs/kube-router/v2``,
  with the one ``replace`` versions.toml names; and our own programs,
  committed as Go sources beside their locked go.mod (``gomod/pause/``: a pod
  sandbox's PID 1; ``gomod/kubernetes/fakegpu/``: a GPU device plugin).

Each group is its own Go module with its own dependency graph (the operators
are HTTP clients of the API server and keep the client-go version they were
released with; containerd keeps its own k8s.io/cri-api and friends).

Cache layout (root: ``$RAYPROOF_CACHE`` or ``~/.cache/rayproof``)::

    src/<key>/{kubernetes,etcd,...,pause}/go.mod (+ main.go for etcd; our own
                                       programs from gomod/<name>/, e.g. pause)
    bin/<key>/etcd, kube-apiserver, ..., kueue, kubelet, ..., pause,
              cni/{ptp,loopback,host-local,portmap}, manifests/, .complete
    bin/<key>.partial/      while a build is in progress (resumable)
    bin/.<key>.lock         serialises concurrent builders

``<key>`` hashes ``versions.toml``'s bytes, the Go version and this file's
``RECIPE`` number. ``bin/<key>`` only ever appears complete: binaries are
linked to a temporary name and renamed into ``bin/<key>.partial``, the
``.complete`` marker is written last, and the directory is then renamed into
place. A second call finds the marker and runs no build at all.

Go's own caches (``go env GOMODCACHE``, ``GOCACHE``) are used as they are: a
rebuild under a new key (e.g. after a comment edit in versions.toml) mostly
re-links. Measured on 2 cores: cold build about 32 minutes (kube-apiserver
11, kueue 12, kube-controller-manager 4, kuberay 4, etcd 1.5) before the node
layer, which adds about 4 more (kubelet and kube-proxy about a minute on the
shared graph, containerd's three 1.7, runc and the CNI plugins seconds,
kube-router 3.3 on its own graph); warm call about 0.02 s.

Run ``python -m clusters.embedded.build`` to build (or find) everything and
print the paths.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from typing import Callable, Iterator

HERE = pathlib.Path(__file__).resolve().parent
VERSIONS_FILE = HERE / "versions.toml"

# Bump when a change here alters what gets built (flags, layout, generated
# go.mod), so that caches made by the old recipe are not reused.
RECIPE = "3"
# The consumer modules' resolved go.mod and go.sum, committed: a build uses
# them read-only (-mod=readonly), so every module and its hash is fixed in the
# repository; `python -m clusters.embedded.build --relock` rewrites them.
LOCKED_MODULES = pathlib.Path(__file__).resolve().parent / "gomod"
COMPONENTS = ("etcd", "kubernetes", "kuberay", "kueue", "containerd", "runc", "cni", "pause", "registry", "coredns",
              "kuberouter")
# The platform's recorded pins (pinned_versions()); the rest is the node layer.
PLATFORM_COMPONENTS = ("kubernetes", "etcd", "kuberay", "kueue")
NODE_COMPONENTS = ("containerd", "runc", "cni", "pause", "registry", "coredns", "kuberouter")
# KubeRay operator versions the embedded platform can be upgraded to
# (`certify --upgrade-to`), each a consumer module locked the same way in
# upgrades/kuberay-<version>/ (`--relock-kuberay VERSION` writes it). Kept
# apart from gomod/ so that adding one leaves the platform's build key alone.
UPGRADE_MODULES = HERE / "upgrades"

BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kuberay-operator",
    "kueue",
    # the node layer
    "kubelet",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "runc",
    "pause",
    "fakegpu",
    "registry",
    "coredns",
    "kube-router",
)
# Programs of our own built on the Kubernetes module graph, each a main package
# committed under gomod/kubernetes/<name>/ (their sources are in the build key):
# fakegpu, the nodes' GPU device plugin (nodes/node.py starts it).
OWN_KUBERNETES_PROGRAMS = ("fakegpu",)
# CNI plugins, built into <bindir>/cni/ (containerd's CNI bin_dir is a
# directory of plugins); ensure_built()'s "cni" is that directory.
CNI_DIR = "cni"
CNI_PLUGINS = ("ptp", "loopback", "host-local", "portmap")
# Where each plugin's main package lives in github.com/containernetworking/plugins.
_CNI_PLUGIN_DIRS = {
    "ptp": "plugins/main/ptp",
    "loopback": "plugins/main/loopback",
    "host-local": "plugins/ipam/host-local",
    "portmap": "plugins/meta/portmap",
}
# containerd's main packages, and the tag its Makefile adds to the shim's.
_CONTAINERD_MAINS = {
    "containerd": "cmd/containerd",
    "containerd-shim-runc-v2": "cmd/containerd-shim-runc-v2",
    "ctr": "cmd/ctr",
}
_CONTAINERD_SHIM_TAGS = "no_grpc"
MARKER = ".complete"
# Bump when the set or layout of copied manifests changes: a finished build
# then gets its manifests/ re-copied from the module cache, with no rebuild.
MANIFESTS_RECIPE = "3"
KUBERAY_SAMPLES = ("ray-cluster.sample.yaml", "ray-job.kueue-toy-sample.yaml")
PROGRESS_INTERVAL_S = 30.0

# Where the main package lives inside each operator's module.
_KUBERAY_MAIN = ""  # module root is the main package
_KUEUE_MAIN = "/cmd/kueue"

_ETCD_MAIN_GO = """\
// Generated by rayproof clusters/embedded/build.py; do not edit.
// The etcd server module carries replace directives, so it cannot be
// installed directly; this main requires it as an ordinary dependency.
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""

# The pause module's go directive: it requires nothing, so no upstream go.mod
# decides it.
_PAUSE_GO = "1.24.0"

Progress = Callable[[str], None]


# --------------------------------------------------------------------------
# Pins, Go toolchain, cache key
# --------------------------------------------------------------------------


def cache_root() -> pathlib.Path:
    """``$RAYPROOF_CACHE`` or ``~/.cache/rayproof``."""
    env = os.environ.get("RAYPROOF_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "rayproof"


def load_versions() -> dict:
    """The parsed ``versions.toml``."""
    with VERSIONS_FILE.open("rb") as fh:
        return tomllib.load(fh)


def pinned_versions() -> dict[str, str]:
    """``{"kubernetes": "v1.35.4", "etcd": "v3.6.16", ...}`` from versions.toml:
    the control plane's and operators' (the platform's recorded pins)."""
    v = load_versions()
    return {name: v[name]["version"] for name in PLATFORM_COMPONENTS}


def node_versions() -> dict[str, str]:
    """The node layer's pins: ``{"kubelet": "v1.35.4", "containerd": "v2.2.9",
    "runc": "v1.4.4", "cni": "v1.9.1", "pause": "3.10.1-rayproof"}``
    (kubelet and kube-proxy are built from the kubernetes pin)."""
    v = load_versions()
    return {"kubelet": v["kubernetes"]["version"], **{name: v[name]["version"] for name in NODE_COMPONENTS}}


def _parse_go_version(text: str) -> tuple[int, ...]:
    m = re.match(r"(?:go)?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if not m:
        raise RuntimeError(f"cannot parse Go version {text!r}")
    return tuple(int(p or 0) for p in m.groups())


def _go_exe() -> str:
    explicit = os.environ.get("RAYPROOF_GO")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise RuntimeError(f"RAYPROOF_GO={explicit} is not an executable go command")
        return explicit
    found = shutil.which("go")
    if not found:
        minimum = load_versions().get("go", {}).get("minimum", "?")
        raise RuntimeError(
            "The embedded platform is built from Go modules, but no `go` command is on PATH. "
            f"Install Go >= {minimum} (the Debian/Ubuntu `golang` package if it is new enough, "
            "or an official Go release) and put its bin/ on PATH, or set RAYPROOF_GO to the "
            "go binary."
        )
    return found


def _go_env(versions: dict, *, cgo: bool = False) -> dict[str, str]:
    """The go command's environment, fixed by the build: nothing of the
    user's Go settings decides what is fetched, verified or built. cgo is off
    (static binaries) unless a component needs it (runc: see
    ``_Component.cgo``)."""
    env = dict(os.environ)
    env["CGO_ENABLED"] = "1" if cgo else "0"
    env["GOWORK"] = "off"
    # The user's GOFLAGS (e.g. -mod=vendor) must not leak into these builds;
    # the generated modules may sit inside someone's git work tree.
    env["GOFLAGS"] = "-buildvcs=false"
    # The machine's own go, unless versions.toml pins a toolchain: a go.mod
    # never downloads one.
    env["GOTOOLCHAIN"] = versions.get("go", {}).get("toolchain", "") or "local"
    # Modules only from the module proxy (no VCS fallback), each checked
    # against the committed go.sum and, for anything not in it, the checksum
    # database; nothing exempted. RAYPROOF_GOPROXY names a mirror of the proxy.
    env["GOPROXY"] = os.environ.get("RAYPROOF_GOPROXY", "https://proxy.golang.org")
    env["GOSUMDB"] = "sum.golang.org"
    for name in ("GONOSUMDB", "GONOSUMCHECK", "GONOPROXY", "GOPRIVATE", "GOINSECURE"):
        env[name] = ""
    return env


def _go_version(go: str, env: dict[str, str]) -> str:
    try:
        out = subprocess.run(
            [go, "env", "GOVERSION"], env=env, capture_output=True, text=True, timeout=300
        )
    except OSError as exc:
        raise RuntimeError(f"cannot run {go}: {exc}") from exc
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(
            f"`{go} env GOVERSION` failed (exit {out.returncode}): {out.stderr.strip()}"
        )
    return out.stdout.strip()


def _check_go(versions: dict, goversion: str) -> None:
    minimum = versions.get("go", {}).get("minimum", "1.0")
    if _parse_go_version(goversion) < _parse_go_version(minimum):
        raise RuntimeError(
            f"Go {goversion} is too old for the pinned modules, which need Go >= {minimum} "
            "(see clusters/embedded/versions.toml). Install a newer Go and put it on PATH, "
            "set RAYPROOF_GO to its go binary, or pin [go] toolchain in versions.toml "
            "(exported as GOTOOLCHAIN)."
        )


def build_key(versions_bytes: bytes, goversion: str) -> str:
    h = hashlib.sha256()
    h.update(f"recipe={RECIPE}\ngo={goversion}\n".encode())
    h.update(versions_bytes)
    # The committed go.mod and go.sum files, and the Go sources of our own programs beside them.
    for path in sorted(p for p in LOCKED_MODULES.rglob("*") if p.is_file() and (p.name.startswith("go.")
                                                                                or p.suffix == ".go")):
        h.update(f"{path.relative_to(LOCKED_MODULES)}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------
# Running go with progress
# --------------------------------------------------------------------------


def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _nice(cmd: list[str]) -> list[str]:
    nice = shutil.which("nice")
    return [nice, "-n", "19", *cmd] if nice else cmd


def _run_go(
    args: list[str],
    *,
    go: str,
    env: dict[str, str],
    cwd: pathlib.Path,
    label: str,
    progress: Progress,
    what: str,
    total_hint: int | None = None,
) -> str:
    """Run ``go <args>`` under ``nice -n 19``; report every PROGRESS_INTERVAL_S.

    Lines that look like import paths (``go build -v`` prints one per compiled
    package) are counted; the whole output is returned; on failure the tail is
    put in the RuntimeError.
    """
    cmd = _nice([go, *args])
    start = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=60)
    lines: list[str] = []
    count = 0
    lock = threading.Lock()

    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )

    def reader() -> None:
        nonlocal count
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            with lock:
                lines.append(line)
                tail.append(line)
                if line and " " not in line and not line.startswith(("#", "go:")):
                    count += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while True:
        try:
            proc.wait(timeout=PROGRESS_INTERVAL_S)
            break
        except subprocess.TimeoutExpired:
            with lock:
                n = count
            of = f" of ~{total_hint} in its build graph" if total_hint else ""
            progress(
                f"  {label}: {what}, {_fmt_s(time.monotonic() - start)} so far"
                + (f", {n} packages compiled{of}" if n else "")
            )
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    t.join()
    if proc.returncode != 0:
        detail = "\n".join(tail)
        raise RuntimeError(
            f"{label}: `go {' '.join(args)}` failed in {cwd} (exit {proc.returncode}).\n"
            f"{detail}\n"
            "If the Go module proxy refused a version, pick a neighbouring served release "
            "in clusters/embedded/versions.toml and record the refusal there."
        )
    return "\n".join(lines)


def _go_capture(args: list[str], *, go: str, env: dict[str, str], cwd: pathlib.Path) -> str:
    out = subprocess.run(
        _nice([go, *args]), cwd=cwd, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"`go {' '.join(args)}` failed in {cwd} (exit {out.returncode}):\n"
            f"{out.stderr.strip()[-4000:]}\n"
            "If the Go module proxy refused a version, pick a neighbouring served release "
            "in clusters/embedded/versions.toml and record the refusal there."
        )
    return out.stdout


def _module_info(mod: str, version: str, *, go: str, env: dict[str, str], cwd: pathlib.Path) -> dict:
    """``go mod download -json mod@version``: Dir, GoMod, Info paths."""
    info = json.loads(_go_capture(["mod", "download", "-json", f"{mod}@{version}"], go=go, env=env, cwd=cwd))
    if info.get("Error"):
        raise RuntimeError(
            f"the Go module proxy did not serve {mod}@{version}: {info['Error']}\n"
            "Pick a neighbouring served release in clusters/embedded/versions.toml and record "
            "the refusal there."
        )
    return info


def _release_date(info: dict) -> str:
    """The module version's publication time (from the proxy's .info), RFC 3339."""
    try:
        data = json.loads(pathlib.Path(info["Info"]).read_text())
        t = _dt.datetime.fromisoformat(data["Time"].replace("Z", "+00:00"))
        return t.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (KeyError, OSError, ValueError):
        return "1970-01-01T00:00:00Z"


# --------------------------------------------------------------------------
# Generated consumer modules
# --------------------------------------------------------------------------


def _upstream_directives(gomod_text: str) -> tuple[str, list[str]]:
    """The ``go`` version and the ``godebug`` lines of an upstream go.mod."""
    m = re.search(r"^go\s+(\S+)\s*$", gomod_text, re.M)
    go_line = m.group(1) if m else "1.24.0"
    godebug: list[str] = []
    in_block = False
    for line in gomod_text.splitlines():
        s = line.strip()
        if in_block:
            godebug.append(line)
            if s == ")":
                in_block = False
        elif s.startswith("godebug"):
            godebug.append(line)
            in_block = s.endswith("(")
    return go_line, godebug


def _staging_replaces(gomod_text: str, staging_version: str) -> list[str]:
    """``k8s.io/x => k8s.io/x v0.Y.Z`` for each ``k8s.io/x => ./staging/...``.

    Upstream replaces that already point at a published version are kept as
    they are; any other local-path replace cannot be honoured and is an error.
    """
    out: list[str] = []
    for line in gomod_text.splitlines():
        m = re.match(r"^\s*(?:replace\s+)?(\S+)(\s+\S+)?\s*=>\s*(\S+)(\s+\S+)?\s*$", line)
        if not m:
            continue
        mod, _, target, tver = m.groups()
        if target.startswith("./staging/"):
            out.append(f"\t{mod} => {mod} {staging_version}")
        elif target.startswith((".", "/")):
            raise RuntimeError(f"k8s.io/kubernetes go.mod has an unexpected local replace: {line.strip()}")
        elif tver:
            out.append(f"\t{mod} => {target}{tver}")
    if not out:
        raise RuntimeError("found no k8s.io staging replaces in the k8s.io/kubernetes go.mod")
    return out


def _gomod(
    module: str,
    go_line: str,
    godebug: list[str],
    requires: list[str],
    tools: list[str],
    replaces: list[str] | None = None,
) -> str:
    parts = [
        "// Generated by rayproof clusters/embedded/build.py from versions.toml; do not edit.",
        f"module {module}",
        "",
        f"go {go_line}",
        "",
    ]
    if godebug:
        parts += [*godebug, ""]
    if requires:  # pause requires nothing
        parts += ["require (", *(f"\t{r}" for r in requires), ")", ""]
    if tools:
        parts += ["tool (", *(f"\t{t}" for t in tools), ")", ""]
    if replaces:
        parts += ["replace (", *replaces, ")", ""]
    return "\n".join(parts)


def _write_if_changed(path: pathlib.Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


class _Component:
    """One generated Go module and the binaries built from it."""

    def __init__(self, name: str, module_dir: pathlib.Path, builds: list[tuple[str, str, str, str]],
                 *, cgo: bool = False):
        self.name = name
        self.dir = module_dir
        # (binary path relative to the bin dir, package path, -tags, -ldflags)
        self.builds = builds
        # Built with CGO_ENABLED=1 (runc: libcontainer/nsenter and libseccomp
        # are C); every other component is static, CGO_ENABLED=0.
        self.cgo = cgo


def _prepare(
    name: str,
    src: pathlib.Path,
    versions: dict,
    *,
    go: str,
    env: dict[str, str],
    progress: Progress,
    relock: bool = False,
    locked: pathlib.Path | None = None,
) -> tuple[_Component, dict]:
    """Write the consumer module for one component from its committed go.mod
    and go.sum (``clusters/embedded/gomod/<name>/``); with ``relock``, resolve
    it afresh (go mod tidy) and write those files."""
    pin = versions[name]
    mdir = src / name
    mdir.mkdir(parents=True, exist_ok=True)
    local = f"rayproof.local/embedded/{name}"
    cgo = False
    if name == "pause":  # our own program: no upstream module
        mod, ver = local, pin["version"]
        info: dict = {}
        gomod_up, released = "", ""
        go_line, godebug = _PAUSE_GO, []
    else:
        mod, ver = pin["module"], pin["version"]
        info = _module_info(mod, ver, go=go, env=env, cwd=src)
        gomod_up = pathlib.Path(info["GoMod"]).read_text()
        go_line, godebug = _upstream_directives(gomod_up)
        released = _release_date(info)

    if name == "kubernetes":
        m = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", ver)
        if not m:
            raise RuntimeError(f"kubernetes version must look like vX.Y.Z, not {ver!r}")
        major, minor = m.group(1), m.group(2)
        staging = pin.get("staging_version") or f"v0.{minor}.{m.group(3)}"
        bins = pin.get("binaries", ["kube-apiserver", "kube-controller-manager", "kube-scheduler"])
        pkgs = [f"{mod}/cmd/{b}" for b in bins]
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], pkgs, _staging_replaces(gomod_up, staging))
        xs = []
        for vpkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            xs += [
                f"-X {vpkg}.gitVersion={ver}",
                f"-X {vpkg}.gitMajor={major}",
                f"-X {vpkg}.gitMinor={minor}",
                f"-X {vpkg}.gitTreeState=clean",
                f"-X {vpkg}.buildDate={released}",
            ]
        ldflags = " ".join(["-s", "-w", *xs])
        builds = [(b, p, pin.get("tags", ""), ldflags) for b, p in zip(bins, pkgs)]
        # Our own programs on the same module graph, committed beside its go.mod (gomod/kubernetes/<name>/).
        builds += [(b, f"{local}/{b}", "", "-s -w") for b in OWN_KUBERNETES_PROGRAMS]
    elif name == "etcd":
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [])
        _write_if_changed(mdir / "main.go", _ETCD_MAIN_GO)
        builds = [("etcd", local, "", "-s -w")]
    elif name == "kuberay":
        pkg = mod + _KUBERAY_MAIN
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [pkg])
        builds = [("kuberay-operator", pkg, "", "-s -w")]
    elif name == "kueue":
        pkg = mod + _KUEUE_MAIN
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [pkg])
        vpkg = "sigs.k8s.io/kueue/pkg/version"
        ldflags = (
            f"-s -w -X {vpkg}.GitVersion={ver} -X {vpkg}.GitCommit=unknown "
            f"-X {vpkg}.BuildDate={released}"
        )
        builds = [("kueue", pkg, "", ldflags)]
    elif name == "containerd":
        pkgs = {b: f"{mod}/{p}" for b, p in _CONTAINERD_MAINS.items()}
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], list(pkgs.values()))
        # As its Makefile: VERSION is `git describe` (with the "v"); no
        # revision is known from the proxy.
        ldflags = f"-s -w -X {mod}/version.Version={ver} -X {mod}/version.Package={mod}"
        tags = pin.get("tags", "")
        builds = [
            (b, p, ",".join(filter(None, [tags, _CONTAINERD_SHIM_TAGS])) if b == "containerd-shim-runc-v2" else tags,
             ldflags)
            for b, p in pkgs.items()
        ]
    elif name == "runc":
        # The module root is the main package; main.version is go:embed'ded
        # from its VERSION file, so nothing is stamped.
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [mod])
        builds = [("runc", mod, pin.get("tags", "seccomp"), "-s -w")]
        cgo = True
    elif name == "cni":
        plugins = pin.get("plugins", list(CNI_PLUGINS))
        if sorted(plugins) != sorted(CNI_PLUGINS):  # _is_complete() and callers know CNI_PLUGINS
            raise RuntimeError(f"versions.toml [cni] plugins {plugins} differ from build.py's CNI_PLUGINS "
                               f"{list(CNI_PLUGINS)}: change both (and _CNI_PLUGIN_DIRS)")
        pkgs = [f"{mod}/{_CNI_PLUGIN_DIRS[p]}" for p in plugins]
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], pkgs)
        ldflags = f"-s -w -X {mod}/pkg/utils/buildversion.BuildVersion={ver}"
        builds = [(f"{CNI_DIR}/{p}", pkg, "", ldflags) for p, pkg in zip(plugins, pkgs)]
    elif name == "registry":
        pkg = f"{mod}/cmd/registry"
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [pkg])
        builds = [("registry", pkg, "", f"-s -w -X {mod}/version.version={ver} -X {mod}/version.mainpkg={mod}")]
    elif name == "coredns":
        # Our own main (gomod/coredns/main.go) with the plugins the Corefile uses.
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [])
        builds = [("coredns", local, "", "-s -w")]
    elif name == "kuberouter":
        pkg = f"{mod}/cmd/kube-router"
        replaces = [f"\t{r}" for r in pin.get("replace", [])]
        text = _gomod(local, go_line, godebug, [f"{mod} {ver}"], [pkg], replaces)
        builds = [("kube-router", pkg, "", f"-s -w -X {mod}/pkg/version.Version={ver} "
                   f"-X {mod}/pkg/version.BuildDate={released}")]
    elif name == "pause":
        text = _gomod(local, go_line, godebug, [], [])  # its main.go is committed beside its go.mod
        builds = [("pause", local, "", f"-s -w -X main.version={ver}")]
    else:  # pragma: no cover - programming error
        raise ValueError(name)

    locked = locked or LOCKED_MODULES / name
    for source in sorted(locked.rglob("*.go")):  # the consumer module's own programs
        (mdir / source.relative_to(locked)).parent.mkdir(parents=True, exist_ok=True)
        _write_if_changed(mdir / source.relative_to(locked), source.read_text())
    if relock:
        _write_if_changed(mdir / "go.mod", text)
        (mdir / "go.sum").unlink(missing_ok=True)
        t0 = time.monotonic()
        progress(f"  {name}: resolving modules ({mod}@{ver}; go mod tidy)")
        _run_go(["mod", "tidy"], go=go, env=env, cwd=mdir, label=name, progress=progress,
                what="resolving/downloading modules")
        locked.mkdir(parents=True, exist_ok=True)
        (locked / "go.mod.in").write_text(text)
        if not (mdir / "go.sum").exists():  # a module that requires nothing (pause)
            (mdir / "go.sum").write_text("")
        for lock_file in ("go.mod", "go.sum"):
            shutil.copyfile(mdir / lock_file, locked / lock_file)
        progress(f"  {name}: modules resolved in {_fmt_s(time.monotonic() - t0)}, locked in {locked}")
    elif not (locked / "go.mod.in").is_file() or (locked / "go.mod.in").read_text() != text:
        raise RuntimeError(f"{locked} was resolved for other pins than {mod}@{ver}; run "
                           "`python -m clusters.embedded.build --relock` (--relock-kuberay VERSION for an upgrade "
                           f"target) and commit {locked.parent}/")
    else:
        for lock_file in ("go.mod", "go.sum"):
            _write_if_changed(mdir / lock_file, (locked / lock_file).read_text())
    return _Component(name, mdir, builds, cgo=cgo), info


# --------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------


def _copy_tree_files(src: pathlib.Path, dst: pathlib.Path, pattern: str = "*.yaml") -> int:
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in sorted(src.glob(pattern)):
        if f.is_file():
            shutil.copyfile(f, dst / f.name)  # module cache files are read-only
            os.chmod(dst / f.name, 0o644)
            n += 1
    return n


def _write_manifests(dest: pathlib.Path, infos: dict[str, dict], versions: dict) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    ray = pathlib.Path(infos["kuberay"]["Dir"])
    kueue = pathlib.Path(infos["kueue"]["Dir"])
    if not _copy_tree_files(ray / "config" / "crd" / "bases", dest / "kuberay" / "crd"):
        raise RuntimeError(f"no KubeRay CRDs under {ray}/config/crd/bases")
    # KubeRay's own samples that need no network at run time (the real nodes' tests run them).
    for sample in KUBERAY_SAMPLES:
        (dest / "kuberay" / "samples").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ray / "config" / "samples" / sample, dest / "kuberay" / "samples" / sample)
    if not _copy_tree_files(kueue / "config" / "components" / "crd" / "bases", dest / "kueue" / "crd"):
        raise RuntimeError(f"no Kueue CRDs under {kueue}/config/components/crd/bases")
    # Which CRDs upstream turns into conversion webhooks (kustomize patches).
    _copy_tree_files(kueue / "config" / "components" / "crd" / "patches",
                     dest / "kueue" / "crd-patches", "webhook_in_*.yaml")
    wh = kueue / "config" / "components" / "webhook" / "manifests.yaml"
    if not wh.is_file():
        raise RuntimeError(f"no Kueue webhook manifests at {wh}")
    (dest / "kueue" / "webhook").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wh, dest / "kueue" / "webhook" / "manifests.yaml")
    # Its kustomization adds the namespaceSelector (NotIn kube-system,
    # kueue-system) to the pod/deployment/statefulset webhooks.
    kz = wh.with_name("kustomization.yaml")
    if kz.is_file():
        shutil.copyfile(kz, dest / "kueue" / "webhook" / "kustomization.yaml")
    cfg = kueue / "config" / "components" / "manager" / "controller_manager_config.yaml"
    if cfg.is_file():
        shutil.copyfile(cfg, dest / "kueue" / "controller_manager_config.yaml")
    for p in dest.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    (dest / "SOURCES.json").write_text(json.dumps({
        "recipe": MANIFESTS_RECIPE,
        "kuberay": {"module": versions["kuberay"]["module"], "version": versions["kuberay"]["version"],
                    "crd": "config/crd/bases/", "samples": [f"config/samples/{s}" for s in KUBERAY_SAMPLES]},
        "kueue": {"module": versions["kueue"]["module"], "version": versions["kueue"]["version"],
                  "crd": "config/components/crd/bases/",
                  "crd-patches": "config/components/crd/patches/webhook_in_*.yaml",
                  "webhook": "config/components/webhook/{manifests,kustomization}.yaml",
                  "controller_manager_config.yaml": "config/components/manager/controller_manager_config.yaml"},
    }, indent=2) + "\n")


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _result(bindir: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {b: bindir / b for b in BINARIES}
    out[CNI_DIR] = bindir / CNI_DIR
    out["manifests"] = bindir / "manifests"
    return out


def _is_complete(bindir: pathlib.Path) -> bool:
    return (
        (bindir / MARKER).is_file()
        and all((bindir / b).is_file() for b in BINARIES)
        and all((bindir / CNI_DIR / p).is_file() for p in CNI_PLUGINS)
        and (bindir / "manifests").is_dir()
    )


def _manifests_current(bindir: pathlib.Path) -> bool:
    try:
        data = json.loads((bindir / "manifests" / "SOURCES.json").read_text())
    except (OSError, ValueError):
        return False
    return data.get("recipe") == MANIFESTS_RECIPE


def _refresh_manifests(bindir: pathlib.Path, versions: dict, *, go: str, env: dict[str, str],
                       progress: Progress) -> None:
    """Re-copy manifests/ of a finished build (after MANIFESTS_RECIPE changed)."""
    progress(f"refreshing copied manifests in {bindir}")
    infos = {
        name: _module_info(versions[name]["module"], versions[name]["version"], go=go, env=env,
                           cwd=bindir)
        for name in ("kuberay", "kueue")
    }
    tmp = bindir / "manifests.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    _write_manifests(tmp, infos, versions)
    old = bindir / "manifests.old"
    if old.exists():
        shutil.rmtree(old)
    os.replace(bindir / "manifests", old)
    os.replace(tmp, bindir / "manifests")
    shutil.rmtree(old)


@contextlib.contextmanager
def _locked(path: pathlib.Path, progress: Progress) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process building into {path.parent} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def current_key() -> tuple[str, str]:
    """(cache key, Go version) for the current versions.toml and Go."""
    versions = load_versions()
    go = _go_exe()
    env = _go_env(versions)
    goversion = _go_version(go, env)
    return build_key(VERSIONS_FILE.read_bytes(), goversion), goversion


def ensure_built(progress: Callable[[str], None] = print) -> dict[str, pathlib.Path]:
    """Build (once) and return the platform's binaries and manifests.

    Returns each name of ``BINARIES`` (``"etcd"``, ``"kube-apiserver"``, ...,
    ``"kubelet"``, ``"containerd"``, ``"runc"``, ``"pause"``, ...), ``"cni"``
    (the directory of the CNI plugins ``CNI_PLUGINS``) and ``"manifests"``
    mapped to paths under ``<cache>/bin/<key>/``. Raises RuntimeError with
    what to do when Go is missing or too old, or a module cannot be had.
    """
    versions_bytes = VERSIONS_FILE.read_bytes()
    versions = tomllib.loads(versions_bytes.decode())
    go = _go_exe()
    env = _go_env(versions)
    goversion = _go_version(go, env)
    _check_go(versions, goversion)
    key = build_key(versions_bytes, goversion)
    root = cache_root()
    final = root / "bin" / key
    if _is_complete(final) and _manifests_current(final):
        return _result(final)

    with _locked(root / "bin" / f".{key}.lock", progress):
        if _is_complete(final):
            if not _manifests_current(final):
                _refresh_manifests(final, versions, go=go, env=env, progress=progress)
            return _result(final)
        if final.exists():  # incomplete leftovers (someone removed the marker)
            shutil.rmtree(final)
        staging = root / "bin" / f"{key}.partial"
        staging.mkdir(parents=True, exist_ok=True)
        src = root / "src" / key
        src.mkdir(parents=True, exist_ok=True)

        t_all = time.monotonic()
        pins = pinned_versions()
        node_pins = node_versions()
        progress(
            f"building the embedded platform with {goversion} into {final} (key {key}): "
            + ", ".join(f"{k} {v}" for k, v in {**pins, **node_pins}.items() if k != "kubelet")
        )
        timings: dict[str, float] = {}
        infos: dict[str, dict] = {}
        for name in COMPONENTS:
            t0 = time.monotonic()
            comp, infos[name] = _prepare(name, src, versions, go=go, env=env, progress=progress)
            timings[f"{name}:modules"] = round(time.monotonic() - t0, 1)
            timings.update(_build_binaries(comp, staging, go=go, env=env, progress=progress))

        _write_manifests(staging / "manifests", infos, versions)
        total_s = time.monotonic() - t_all
        timings["total"] = round(total_s, 1)
        marker = {
            "key": key,
            "recipe": RECIPE,
            "go": goversion,
            "versions": pins,
            "node_versions": node_pins,
            "built_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seconds": timings,
            "src": str(src),
        }
        tmp_marker = staging / f"{MARKER}.tmp"
        with open(tmp_marker, "w") as fh:
            fh.write(json.dumps(marker, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_marker, staging / MARKER)
        os.replace(staging, final)
        progress(f"embedded platform built in {_fmt_s(total_s)}: {final}")
        return _result(final)


def _build_binaries(comp: _Component, staging: pathlib.Path, *, go: str, env: dict[str, str],
                    progress: Progress) -> dict[str, float]:
    """Build each binary of ``comp`` into ``staging`` (one already there from an
    interrupted run is kept); returns the seconds each took."""
    timings: dict[str, float] = {}
    env = {**env, "CGO_ENABLED": "1" if comp.cgo else "0"}
    for binary, pkg, tags, ldflags in comp.builds:
        dest = staging / binary
        if dest.is_file():
            progress(f"  {binary}: already built by an interrupted run, kept")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        t1 = time.monotonic()
        progress(f"[{binary}] building {pkg}" + (" (cgo)" if comp.cgo else ""))
        try:
            listed = _go_capture(["list", "-mod=readonly", "-deps", *(["-tags", tags] if tags else []), pkg],
                                 go=go, env=env, cwd=comp.dir)
            total = len(listed.split())
        except RuntimeError:
            total = None
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.unlink(missing_ok=True)
        args = ["build", "-mod=readonly", "-v", "-trimpath"]  # go.mod and go.sum as committed
        if tags:
            args += ["-tags", tags]
        args += ["-ldflags", ldflags, "-o", str(tmp), pkg]
        _run_go(args, go=go, env=env, cwd=comp.dir, label=binary, progress=progress,
                what="compiling", total_hint=total)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
        dt = time.monotonic() - t1
        timings[binary] = round(dt, 1)
        progress(f"[{binary}] done in {_fmt_s(dt)} ({dest.stat().st_size / 2**20:.0f} MiB)")
    return timings


def kuberay_upgrade_versions() -> list[str]:
    """The KubeRay versions the embedded platform can be upgraded to (each locked in upgrades/)."""
    return sorted(p.name.removeprefix("kuberay-") for p in UPGRADE_MODULES.glob("kuberay-v*")
                  if (p / "go.mod.in").is_file())


def _kuberay_pins(version: str) -> dict:
    versions = load_versions()
    return {**versions, "kuberay": {**versions["kuberay"], "version": version}}


def ensure_kuberay_built(version: str, progress: Callable[[str], None] = print) -> dict[str, pathlib.Path]:
    """Build (once) the KubeRay operator at ``version``, an upgrade target of
    the embedded platform, from its published module and the go.mod and
    go.sum locked in ``upgrades/kuberay-<version>/``. Returns
    ``{"kuberay-operator": binary, "crds": directory of its CRDs}`` under
    ``<cache>/bin/kuberay-<version>-<key>/``. The pinned version is the
    platform's own build (an upgrade to it redeploys the operator). Raises
    ValueError for a version that is not locked here, RuntimeError when Go or
    a module cannot be had."""
    if version == load_versions()["kuberay"]["version"]:
        own = ensure_built(progress)
        return {"kuberay-operator": own["kuberay-operator"], "crds": own["manifests"] / "kuberay" / "crd"}
    lock = UPGRADE_MODULES / f"kuberay-{version}"
    if version not in kuberay_upgrade_versions():
        raise ValueError(f"KubeRay {version} is not an upgrade target of the embedded platform (locked: "
                         f"{', '.join(kuberay_upgrade_versions()) or 'none'}); lock one with `python -m "
                         "clusters.embedded.build --relock-kuberay VERSION` and commit clusters/embedded/upgrades/")
    versions = _kuberay_pins(version)
    go = _go_exe()
    env = _go_env(versions)
    goversion = _go_version(go, env)
    _check_go(versions, goversion)
    h = hashlib.sha256(f"recipe={RECIPE}\ngo={goversion}\n".encode())
    for path in sorted(lock.glob("go.*")):
        h.update(path.read_bytes())
    root = cache_root()
    final = root / "bin" / f"kuberay-{version}-{h.hexdigest()[:16]}"
    result = {"kuberay-operator": final / "kuberay-operator", "crds": final / "crd"}
    if (final / MARKER).is_file():
        return result
    with _locked(root / "bin" / f".{final.name}.lock", progress):
        if (final / MARKER).is_file():
            return result
        staging = final.with_name(final.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        progress(f"building the KubeRay operator {version} with {goversion} into {final}")
        src = root / "src" / final.name
        src.mkdir(parents=True, exist_ok=True)
        comp, info = _prepare("kuberay", src, versions, go=go, env=env,
                              progress=progress, locked=lock)
        timings = _build_binaries(comp, staging, go=go, env=env, progress=progress)
        crds = pathlib.Path(info["Dir"]) / "config" / "crd" / "bases"
        if (staging / "crd").exists():
            shutil.rmtree(staging / "crd")
        if not _copy_tree_files(crds, staging / "crd"):
            raise RuntimeError(f"no KubeRay CRDs under {crds}")
        (staging / MARKER).write_text(json.dumps({"module": versions["kuberay"]["module"], "version": version,
                                                  "go": goversion, "seconds": timings}, indent=2) + "\n")
        os.replace(staging, final)
        progress(f"KubeRay operator {version} built in {_fmt_s(time.monotonic() - t0)}: {final}")
    return result


def relock_kuberay(version: str, progress: Callable[[str], None] = print) -> None:
    """Resolve the KubeRay operator ``version``'s consumer module and write its
    go.mod and go.sum to ``upgrades/kuberay-<version>/``; builds nothing."""
    if not re.fullmatch(r"v\d+\.\d+\.\d+", version):
        raise ValueError(f"a KubeRay version looks like v1.6.0, not {version!r}")
    versions = _kuberay_pins(version)
    go = _go_exe()
    env = _go_env(versions)
    _check_go(versions, _go_version(go, env))
    src = cache_root() / "src" / f"relock-kuberay-{version}"
    src.mkdir(parents=True, exist_ok=True)
    _prepare("kuberay", src, versions, go=go, env=env, progress=progress, relock=True,
             locked=UPGRADE_MODULES / f"kuberay-{version}")


def relock(progress: Callable[[str], None] = print) -> None:
    """Resolve every component's consumer module afresh and write its go.mod
    and go.sum to ``clusters/embedded/gomod/`` (after a pin in versions.toml
    changed); builds nothing."""
    versions = tomllib.loads(VERSIONS_FILE.read_text())
    go = _go_exe()
    env = _go_env(versions)
    _check_go(versions, _go_version(go, env))
    src = cache_root() / "src" / "relock"
    src.mkdir(parents=True, exist_ok=True)
    for name in COMPONENTS:
        _prepare(name, src, versions, go=go, env=env, progress=progress, relock=True)


def manifests_dir(progress: Callable[[str], None] = print) -> pathlib.Path:
    """The directory of copied CRDs/webhook manifests (builds if needed)."""
    return ensure_built(progress)["manifests"]


def build_info(bindir: pathlib.Path) -> dict:
    """The ``.complete`` marker of a finished build directory."""
    return json.loads((bindir / MARKER).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clusters.embedded.build",
        description="Build (or find in the cache) the embedded platform's upstream binaries.",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", action="store_true", help="print the paths as JSON")
    parser.add_argument("--relock", action="store_true",
                        help="resolve the pinned modules afresh into clusters/embedded/gomod/ (go.mod, go.sum); "
                             "run after changing versions.toml, then commit them")
    parser.add_argument("--relock-kuberay", metavar="VERSION",
                        help="lock the KubeRay operator VERSION as an upgrade target into clusters/embedded/upgrades/")
    parser.add_argument("--kuberay", metavar="VERSION",
                        help="build (or find) the KubeRay operator VERSION, an upgrade target, instead")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    log: Progress = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        if args.relock:
            relock(log)
            return 0
        if args.relock_kuberay:
            relock_kuberay(args.relock_kuberay, log)
            return 0
        paths = ensure_kuberay_built(args.kuberay, log) if args.kuberay else ensure_built(log)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - t0
    if args.json:
        print(json.dumps({k: str(v) for k, v in paths.items()} | {"elapsed_s": round(elapsed, 3)}, indent=2))
    else:
        for name, path in paths.items():
            print(f"{name:24s} {path}")
        print(f"elapsed {elapsed:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
