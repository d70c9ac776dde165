"""An existing cluster, reached by a kubeconfig (``--kubeconfig``).

Nothing is installed or reconfigured: the suite certifies the cluster as its
operators configured it. Before any clause runs, :mod:`clusters.preflight`
checks that the API server answers, the KubeRay and Kueue CRDs are served and
the identity may do what the clauses do; a failure there is one message and
nothing is created.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from clusters import UpgradeFailed

# Where upstream installs put the operators, and the container whose image tag
# is their version (KubeRay's Helm chart and Kueue's manifests/Helm chart).
OPERATOR_DEPLOYMENTS = {
    "kuberay": ("app.kubernetes.io/name=kuberay-operator", "kuberay-operator"),
    "kueue": ("control-plane=controller-manager,app.kubernetes.io/name=kueue", "kueue-controller-manager"),
}


def _check_context(path: Path, context: str | None) -> None:
    """A kubeconfig that cannot be read, or a ``--context`` it does not have,
    is bad input: one message, before anything talks to a cluster."""
    from kubernetes import config

    try:
        contexts, current = config.list_kube_config_contexts(config_file=str(path))
    except Exception as exc:  # noqa: BLE001 - YAML and kubeconfig errors alike: the file is not usable
        raise ValueError(f"kubeconfig {path} cannot be read as a kubeconfig ({str(exc).strip()[:200]}); "
                         "pass a kubeconfig file with at least one context") from None
    names = [c["name"] for c in contexts]
    if context and context not in names:
        raise ValueError(f"kubeconfig {path} has no context {context!r}; it has {', '.join(names)} "
                         "(pass one of them with --context)")
    if not context and not current:
        raise ValueError(f"kubeconfig {path} sets no current-context; name one of {', '.join(names)} with --context")


class ExistingCluster:
    """A cluster this process neither started nor will stop."""

    kind = "existing"
    # Its pods run on its own nodes, not on the CPUs of the machine running the suite.
    runs_on_this_machine = False

    def __init__(self, kubeconfig: str | Path, *, context: str | None = None):
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"kubeconfig {path} does not exist; pass the path of a kubeconfig file "
                                    "(or omit --kubeconfig to use the embedded platform)")
        self._kubeconfig = path.resolve()
        self.context = context
        _check_context(self._kubeconfig, context)

    @property
    def kubeconfig(self) -> Path:
        return self._kubeconfig

    @property
    def identity(self) -> str:
        return self.api_client().configuration.host

    def api_client(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self._kubeconfig), context=self.context)

    def describe(self) -> dict[str, Any]:
        api = self.api_client()
        info = describe_cluster(api)
        info["kind"] = "existing cluster"
        info["versions"].update(operator_versions(api))
        return info

    def outside(self, probe: Any) -> Any:
        """From this host's network: where the user running the suite stands, outside their cluster."""
        return probe()

    def diagnose(self) -> str:
        return node_health(self.api_client())

    def prepare_kuberay_upgrade(self, version: str, progress: Any = print) -> None:
        """Nothing: the person running the suite upgrades the operator when asked."""

    def upgrade_kuberay(self, version: str, progress: Any = print) -> dict[str, Any]:
        """The suite does not upgrade what it did not install: it asks the
        person running it to, and waits until KubeRay's operator Deployment
        runs an image tagged ``version`` and has rolled out."""
        from core import timeouts
        from core.waiting import WaitTimeout, wait_for

        api = self.api_client()
        before = operator_versions(api)["kuberay"]
        if before == version:
            # Its Deployment already runs the tag: waiting for it would pass at once, with nothing upgraded.
            raise RuntimeError(f"the KubeRay operator of this cluster already runs {version}: nothing to upgrade")
        progress(f"upgrade the KubeRay operator of this cluster from {before} to {version} now, as you would "
                 "(CRDs first, then the operator, e.g. `helm upgrade` of its chart); the suite's RayService and "
                 "RayJob keep running and are measured meanwhile. Waiting up to "
                 f"{timeouts.OPERATOR_UPGRADE.seconds / 60:g} min (RAYPROOF_TIMEOUT_OPERATOR_UPGRADE) for the "
                 f"operator Deployment to run {version}")
        started = time.time()
        try:
            wait_for(lambda: kuberay_rollout(api), lambda seen: seen["tag"] == version and seen["rolled_out"],
                     timeout=timeouts.OPERATOR_UPGRADE, interval=5,
                     description=f"KubeRay's operator Deployment to run an image tagged {version}, rolled out")
        except WaitTimeout as exc:
            raise UpgradeFailed(str(exc)) from exc
        return {"from": before, "to": version, "asked_at": started, "operator_ready_at": time.time()}

    def close(self) -> None:
        """Nothing to do: the cluster was here before and stays."""


def node_shape(allocatable: dict[str, str], capacity: dict[str, str]) -> str:
    """What a node offers pods (its allocatable cpu, memory and GPUs), and its capacity where that differs."""
    names = ("cpu", "memory", "nvidia.com/gpu")
    offered = "allocatable " + ", ".join(f"{n}={allocatable.get(n, capacity.get(n, '0'))}" for n in names)
    held_back = {n: capacity[n] for n in names if n in capacity and capacity[n] != allocatable.get(n, capacity[n])}
    return offered + (f" (capacity {', '.join(f'{n}={v}' for n, v in held_back.items())})" if held_back else "")


def describe_cluster(api: Any) -> dict[str, Any]:
    """Server URL, Kubernetes version and the nodes' shape, from the API."""
    from kubernetes import client

    version = client.VersionApi(api).get_code()
    nodes = client.CoreV1Api(api).list_node().items
    shapes: dict[str, int] = {}
    for node in nodes:
        key = node_shape(node.status.allocatable or {}, node.status.capacity or {})
        shapes[key] = shapes.get(key, 0) + 1
    return {
        "server": api.configuration.host,
        "versions": {"kubernetes": version.git_version},
        "nodes": len(nodes),
        "node_shapes": shapes,
    }


def node_health(api: Any) -> str:
    """One line per node that is not Ready or reports a pressure condition; "all N nodes Ready" otherwise."""
    from kubernetes import client

    nodes = client.CoreV1Api(api).list_node().items
    bad = []
    for node in nodes:
        conds = {c.type: c for c in node.status.conditions or []}
        ready = conds.get("Ready")
        pressure = [t for t, c in conds.items() if t != "Ready" and c.status == "True"]
        if not ready or ready.status != "True" or pressure:
            bad.append(f"node {node.metadata.name}: Ready={ready.status if ready else 'absent'}"
                       f" ({ready.reason if ready else ''}: {ready.message if ready else ''}); conditions true: {pressure}")
    return "\n".join(bad) if bad else f"all {len(nodes)} nodes Ready, none under pressure"


def operator_deployments(api: Any) -> dict[str, list[Any]]:
    """KubeRay's and Kueue's Deployments, by operator (empty where none is
    found: an operator may run outside the cluster)."""
    from kubernetes import client

    apps = client.AppsV1Api(api)
    out = {}
    for name, (selector, fallback_name) in OPERATOR_DEPLOYMENTS.items():
        deps = apps.list_deployment_for_all_namespaces(label_selector=selector).items
        if not deps:
            deps = [d for d in apps.list_deployment_for_all_namespaces().items if d.metadata.name == fallback_name]
        out[name] = deps
    return out


def image_tag(deployment: Any) -> str | None:
    """The tag of the first container image of a Deployment that has one."""
    for c in deployment.spec.template.spec.containers:
        if ":" in c.image.rsplit("/", 1)[-1]:
            return c.image.rsplit(":", 1)[1]
    return None


def kuberay_rollout(api: Any) -> dict[str, Any]:
    """KubeRay's operator Deployment: its image tag and whether its rollout is
    done (observed, every replica updated and available)."""
    deps = operator_deployments(api)["kuberay"]
    if not deps:
        return {"tag": None, "rolled_out": False, "why": "no KubeRay operator Deployment found"}
    d = deps[0]
    st = d.status
    want = d.spec.replicas if d.spec.replicas is not None else 1
    done = ((st.observed_generation or 0) >= (d.metadata.generation or 0) and (st.updated_replicas or 0) == want
            and (st.available_replicas or 0) == want and not (st.replicas or 0) > want)
    return {"deployment": f"{d.metadata.namespace}/{d.metadata.name}", "tag": image_tag(d), "rolled_out": done}


def operator_versions(api: Any) -> dict[str, str]:
    """KubeRay's and Kueue's versions from their Deployments' image tags ("unknown" when not found)."""
    from kubernetes import client

    try:
        found = operator_deployments(api)
    except client.ApiException as exc:
        return {name: f"unknown (cannot list deployments: HTTP {exc.status})" for name in OPERATOR_DEPLOYMENTS}
    return {name: next((tag for tag in map(image_tag, deps) if tag), "unknown") for name, deps in found.items()}
