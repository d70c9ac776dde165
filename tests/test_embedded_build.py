"""The embedded platform's upstream programs build from published Go modules.

Calls ``clusters.embedded.build.ensure_built()`` (a cold build takes tens of
minutes on two cores; later calls find the cache and build nothing), then
checks that every binary runs and reports the version pinned in
``clusters/embedded/versions.toml`` (the node layer's too: kubelet,
kube-proxy, containerd, runc with seccomp, the CNI plugins, pause), and that
the CRDs and webhook manifests were copied out of the module cache.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import time

import pytest
import yaml

from clusters.embedded import build

pytestmark = pytest.mark.slow

PINS = build.pinned_versions()
VERSIONS = build.load_versions()


@pytest.fixture(scope="module")
def built() -> dict[str, pathlib.Path]:
    return build.ensure_built(progress=print)


def _run(argv: list[str], tmp_path: pathlib.Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # No kubeconfig, no in-cluster service account: nothing gets contacted.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
    }
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def _build_info(path: pathlib.Path) -> str:
    """``go version -m`` of a binary: its module dependencies and build settings."""
    out = subprocess.run(
        [build._go_exe(), "version", "-m", str(path)], capture_output=True, text=True, check=True
    )
    return out.stdout


def test_every_binary_is_built(built: dict[str, pathlib.Path]) -> None:
    for name in build.BINARIES:
        path = built[name]
        assert path.is_file(), name
        assert os.access(path, os.X_OK), name
    assert built["cni"] == built["etcd"].parent / "cni"
    for plugin in build.CNI_PLUGINS:
        assert os.access(built["cni"] / plugin, os.X_OK), plugin
    info = build.build_info(built["etcd"].parent)
    assert info["versions"] == PINS
    assert info["node_versions"] == build.node_versions()


@pytest.mark.parametrize("name", ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet",
                                  "kube-proxy"])
def test_kubernetes_binaries_report_pinned_version(
    built: dict[str, pathlib.Path], name: str, tmp_path: pathlib.Path
) -> None:
    res = _run([str(built[name]), "--version"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"Kubernetes {PINS['kubernetes']}", res.stdout


def test_etcd_reports_pinned_version(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    res = _run([str(built["etcd"]), "--version"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"etcd Version: {PINS['etcd'].removeprefix('v')}" in res.stdout, res.stdout


def test_containerd_and_ctr_report_pinned_version(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    # As a release build: `containerd github.com/containerd/containerd/v2 v2.2.9`
    # (CRI's RuntimeVersion is the same v2.2.9; kubelet shows containerd://2.2.9).
    version = VERSIONS["containerd"]["version"]
    res = _run([str(built["containerd"]), "--version"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[:3] == ["containerd", VERSIONS["containerd"]["module"], version], res.stdout
    res = _run([str(built["ctr"]), "--version"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ctr", VERSIONS["containerd"]["module"], version], res.stdout
    res = _run([str(built["containerd-shim-runc-v2"]), "-v"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"Version:  {version}" in res.stdout, res.stdout


def test_runc_reports_pinned_version_with_seccomp(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    res = _run([str(built["runc"]), "--version"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"runc version {VERSIONS['runc']['version'].removeprefix('v')}\n"), res.stdout
    # Only printed when built with the seccomp tag against libseccomp.
    assert re.search(r"^libseccomp: \d+\.\d+\.\d+$", res.stdout, re.M), res.stdout
    res = _run([str(built["runc"]), "features"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert '"enabled": true' in res.stdout.split('"seccomp"', 1)[1][:200], res.stdout


@pytest.mark.parametrize("plugin", build.CNI_PLUGINS)
def test_cni_plugins_report_pinned_version(built: dict[str, pathlib.Path], plugin: str, tmp_path: pathlib.Path) -> None:
    # Every CNI plugin answers the VERSION command (CNI_COMMAND=VERSION) with
    # the spec versions it supports, and prints its build string on stderr
    # when run without a command.
    res = subprocess.run([str(built["cni"] / plugin)], cwd=tmp_path, env={"CNI_COMMAND": "VERSION"},
                         input="{}", capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert '"supportedVersions"' in res.stdout, res.stdout
    res = subprocess.run([str(built["cni"] / plugin)], cwd=tmp_path, env={}, capture_output=True, text=True,
                         timeout=60)
    assert f"CNI {plugin} plugin {VERSIONS['cni']['version']}" in res.stderr, res.stderr


def test_pause_is_static_and_exits_on_sigterm(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    import signal

    pause = built["pause"]
    res = _run([str(pause), "-v"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"rayproof pause {VERSIONS['pause']['version']}", res.stdout
    # Static: no program interpreter (a dynamic ELF names ld-linux in PT_INTERP).
    assert b"ld-linux" not in pause.read_bytes()
    assert "\tbuild\tCGO_ENABLED=0\n" in _build_info(pause)
    proc = subprocess.Popen([str(pause)], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    # pause writes its warning once its signal handlers are in place (EOF here if it died first).
    assert proc.stderr.readline().strip() == "pause: warning: not running as PID 1"
    assert proc.poll() is None, "pause exited by itself"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_kueue_reports_pinned_version(built: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    # Kueue has no --version: it logs its stamped version at start-up, before
    # it loads the kubeconfig, which here does not exist, so it then exits.
    res = _run([str(built["kueue"]), f"--kubeconfig={tmp_path / 'missing-kubeconfig'}"], tmp_path)
    assert res.returncode != 0
    assert f'"gitVersion":"{PINS["kueue"]}"' in res.stderr, res.stderr[-3000:]


def test_kuberay_operator_runs_and_has_out_of_cluster_flags(
    built: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # KubeRay has no --version (its version is the constant
    # utils.KUBERAY_VERSION); -h must work and list the flags the launcher uses.
    res = _run([str(built["kuberay-operator"]), "-h"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    for flag in ("-kubeconfig", "-enable-leader-election", "-metrics-addr",
                 "-health-probe-bind-address", "-use-kubernetes-proxy", "-feature-gates"):
        assert flag in res.stderr, flag


@pytest.mark.parametrize(
    ("name", "component"),
    [
        ("kube-apiserver", "kubernetes"),
        ("kube-controller-manager", "kubernetes"),
        ("kube-scheduler", "kubernetes"),
        ("kubelet", "kubernetes"),
        ("kube-proxy", "kubernetes"),
        ("etcd", "etcd"),
        ("kuberay-operator", "kuberay"),
        ("kueue", "kueue"),
        ("containerd", "containerd"),
        ("containerd-shim-runc-v2", "containerd"),
        ("ctr", "containerd"),
        ("runc", "runc"),
        ("cni/ptp", "cni"),
        ("cni/portmap", "cni"),
    ],
)
def test_binary_built_from_pinned_module(
    built: dict[str, pathlib.Path], name: str, component: str
) -> None:
    info = _build_info(built["etcd"].parent / name)
    module, version = VERSIONS[component]["module"], VERSIONS[component]["version"]
    # "mod" when the upstream module holds the main package, "dep" otherwise.
    assert re.search(rf"^\t(mod|dep)\t{re.escape(module)}\t{re.escape(version)}\t", info, re.M), info[:3000]
    # Static, except runc (libcontainer/nsenter and libseccomp are C).
    cgo = "1" if component == "runc" else "0"
    assert f"\tbuild\tCGO_ENABLED={cgo}\n" in info, info[:3000]


def test_kubernetes_staging_modules_match_release(built: dict[str, pathlib.Path]) -> None:
    info = _build_info(built["kube-apiserver"])
    staging = VERSIONS["kubernetes"]["staging_version"]
    for mod in ("k8s.io/api", "k8s.io/apiserver", "k8s.io/client-go", "k8s.io/component-base"):
        assert f"\t=>\t{mod}\t{staging}\t" in info, mod


def _docs(directory: pathlib.Path) -> list[dict]:
    docs: list[dict] = []
    for f in sorted(directory.rglob("*.yaml")):
        if f.name == "kustomization.yaml" or f.parent.name == "crd-patches":
            continue
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are large
        docs += [d for d in yaml.load_all(f.read_text(), Loader=loader) if d]
    return docs


def test_manifests_contain_crds_and_webhooks(built: dict[str, pathlib.Path]) -> None:
    manifests = built["manifests"]
    assert manifests == build.manifests_dir(progress=print)
    docs = _docs(manifests)
    crds = {d["metadata"]["name"] for d in docs if d.get("kind") == "CustomResourceDefinition"}
    for name in (
        "rayclusters.ray.io",
        "rayjobs.ray.io",
        "rayservices.ray.io",
        "clusterqueues.kueue.x-k8s.io",
        "localqueues.kueue.x-k8s.io",
        "workloads.kueue.x-k8s.io",
        "resourceflavors.kueue.x-k8s.io",
        "workloadpriorityclasses.kueue.x-k8s.io",
        "cohorts.kueue.x-k8s.io",
        "admissionchecks.kueue.x-k8s.io",
    ):
        assert name in crds, name
    hooks = {d["kind"]: d for d in docs if d.get("kind", "").endswith("WebhookConfiguration")}
    assert set(hooks) == {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    paths = {
        w["clientConfig"]["service"]["path"] for d in hooks.values() for w in d["webhooks"]
    }
    for path in ("/mutate-ray-io-v1-rayjob", "/validate-ray-io-v1-raycluster",
                 "/mutate-kueue-x-k8s-io-v1beta2-workload", "/validate-batch-v1-job"):
        assert path in paths, path


def test_second_call_builds_nothing(built: dict[str, pathlib.Path]) -> None:
    messages: list[str] = []
    t0 = time.monotonic()
    again = build.ensure_built(progress=messages.append)
    elapsed = time.monotonic() - t0
    assert again == built
    assert messages == []
    assert elapsed < 10, elapsed


@pytest.mark.parametrize("name", ["kube-apiserver", "kubelet", "etcd", "kuberay-operator", "kueue", "containerd",
                                  "runc", "cni/ptp"])
def test_every_module_in_a_binary_is_the_committed_go_sum_s(built: dict[str, pathlib.Path], name: str) -> None:
    """Built read-only from clusters/embedded/gomod/: each module compiled in
    is listed, with the same hash, in the committed go.sum of its component."""
    component = {"kube-apiserver": "kubernetes", "kubelet": "kubernetes", "kuberay-operator": "kuberay",
                 "cni/ptp": "cni"}.get(name, name)
    go_sum = (build.LOCKED_MODULES / component / "go.sum").read_text()
    modules = re.findall(r"^\t(?:dep|=>)\t(\S+)\t(\S+)\t(h1:\S+)$",
                         _build_info(built["etcd"].parent / name), re.M)
    assert len(modules) > 5, modules
    missing = [f"{mod} {version} {digest}" for mod, version, digest in modules
               if f"{mod} {version} {digest}\n" not in go_sum]
    assert not missing, missing


def test_the_go_environment_is_fixed_by_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "auto", "GOPROXY": "https://example.invalid,direct",
                        "GOSUMDB": "off", "GONOSUMDB": "*", "GOPRIVATE": "*", "GOINSECURE": "*"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CGO_ENABLED", "1")
    env = build._go_env(VERSIONS)
    assert (env["GOFLAGS"], env["GOTOOLCHAIN"], env["GOPROXY"], env["GOSUMDB"]) == (
        "-buildvcs=false", "local", "https://proxy.golang.org", "sum.golang.org")
    assert env["GONOSUMDB"] == env["GOPRIVATE"] == env["GOINSECURE"] == ""
    assert env["CGO_ENABLED"] == "0"
    assert build._go_env(VERSIONS, cgo=True)["CGO_ENABLED"] == "1"


def test_a_lock_made_for_other_pins_is_refused(built, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    locked = tmp_path / "gomod"
    shutil.copytree(build.LOCKED_MODULES, locked)
    template = locked / "kuberay" / "go.mod.in"
    template.write_text(template.read_text().replace(VERSIONS["kuberay"]["version"], "v1.4.0"))
    monkeypatch.setattr(build, "LOCKED_MODULES", locked)
    versions = build.load_versions()
    env = build._go_env(versions)
    (tmp_path / "src").mkdir()
    with pytest.raises(RuntimeError, match=r"resolved for other pins .* --relock"):
        build._prepare("kuberay", tmp_path / "src", versions, go=build._go_exe(), env=env, progress=lambda m: None)
