"""The embedded platform's upstream programs build from published Go modules.

Calls ``clusters.embedded.build.ensure_built()`` (a cold build takes tens of
minutes on two cores; later calls find the cache and build nothing), then
checks that every binary runs and reports the version pinned in
``clusters/embedded/versions.toml``, and that the CRDs and webhook manifests
were copied out of the module cache.
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
    info = build.build_info(built["etcd"].parent)
    assert info["versions"] == PINS


@pytest.mark.parametrize("name", ["kube-apiserver", "kube-controller-manager", "kube-scheduler"])
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
        ("etcd", "etcd"),
        ("kuberay-operator", "kuberay"),
        ("kueue", "kueue"),
    ],
)
def test_binary_built_from_pinned_module(
    built: dict[str, pathlib.Path], name: str, component: str
) -> None:
    info = _build_info(built[name])
    module, version = VERSIONS[component]["module"], VERSIONS[component]["version"]
    # "mod" when the upstream module holds the main package, "dep" otherwise.
    assert re.search(rf"^\t(mod|dep)\t{re.escape(module)}\t{re.escape(version)}\t", info, re.M), info[:3000]
    assert "\tbuild\tCGO_ENABLED=0\n" in info, info[:3000]


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


@pytest.mark.parametrize("name", ["kube-apiserver", "etcd", "kuberay-operator", "kueue"])
def test_every_module_in_a_binary_is_the_committed_go_sum_s(built: dict[str, pathlib.Path], name: str) -> None:
    """Built read-only from clusters/embedded/gomod/: each module compiled in
    is listed, with the same hash, in the committed go.sum of its component."""
    component = {"kube-apiserver": "kubernetes", "kuberay-operator": "kuberay"}.get(name, name)
    go_sum = (build.LOCKED_MODULES / component / "go.sum").read_text()
    modules = re.findall(r"^\t(?:dep|=>)\t(\S+)\t(\S+)\t(h1:\S+)$", _build_info(built[name]), re.M)
    assert len(modules) > 10, modules
    missing = [f"{mod} {version} {digest}" for mod, version, digest in modules
               if f"{mod} {version} {digest}\n" not in go_sum]
    assert not missing, missing


def test_the_go_environment_is_fixed_by_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "auto", "GOPROXY": "https://example.invalid,direct",
                        "GOSUMDB": "off", "GONOSUMDB": "*", "GOPRIVATE": "*", "GOINSECURE": "*"}.items():
        monkeypatch.setenv(name, value)
    env = build._go_env(VERSIONS)
    assert (env["GOFLAGS"], env["GOTOOLCHAIN"], env["GOPROXY"], env["GOSUMDB"]) == (
        "-buildvcs=false", "local", "https://proxy.golang.org", "sum.golang.org")
    assert env["GONOSUMDB"] == env["GOPRIVATE"] == env["GOINSECURE"] == ""


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
