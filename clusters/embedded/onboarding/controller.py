"""The reference platform's namespace onboarding: a team labels a new
namespace, the platform provisions its queues and policies.

A namespace labelled ``onboarding.rayproof.io/class: <class>`` gets the
objects of that class (a ClusterQueue for its tenant, a LocalQueue, the
NetworkPolicies), rendered from the class's multi-document YAML with
``${namespace}``, ``${tenant}`` and ``${gpu_quota}`` filled in from the
namespace's name and its ``onboarding.rayproof.io/tenant`` and
``onboarding.rayproof.io/gpu-quota`` labels. Classes are ConfigMaps
``onboarding-class-<class>`` (key ``objects.yaml``) in the
``rayproof-onboarding`` namespace; ``up`` installs the ones shipped beside
this file (``standard.yaml``), and an operator may add more.

What it made is labelled ``app.kubernetes.io/managed-by: rayproof-onboarding``
and with its tenant; a tenant's cluster-scoped objects are deleted once no
namespace of that tenant is left. Once onboarded, the namespace is annotated
``onboarding.rayproof.io/onboarded: <class>``; a class that is missing or
does not render is written to ``onboarding.rayproof.io/error`` instead.

This is the platform's side: the suite never imports it. It stands where a
real platform has its onboarding automation (a GitOps repository, a policy
engine's generate rules, an operator of its own).
"""
from __future__ import annotations

import logging
import re
import string
import threading
from pathlib import Path
from typing import Any, Mapping

import yaml

log = logging.getLogger(__name__)

CLASS_LABEL = "onboarding.rayproof.io/class"
TENANT_LABEL = "onboarding.rayproof.io/tenant"
GPU_QUOTA_LABEL = "onboarding.rayproof.io/gpu-quota"
ONBOARDED_ANNOTATION = "onboarding.rayproof.io/onboarded"
ERROR_ANNOTATION = "onboarding.rayproof.io/error"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rayproof-onboarding"}
CLASSES_NAMESPACE = "rayproof-onboarding"
CLASS_KEY = "objects.yaml"
ONBOARDING_DIR = Path(__file__).resolve().parent
WATCH_S = 10  # one namespace watch; after it, a full resync (and the tenants' garbage collection)
RETRY_S = 2.0  # back-off after a failed API call

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class OnboardingError(ValueError):
    """A class that is missing or does not render for a namespace."""


def class_configmap_name(name: str) -> str:
    return f"onboarding-class-{name}"


def shipped_classes() -> dict[str, str]:
    """The classes shipped with the reference platform: {name: objects.yaml text}."""
    return {p.stem: p.read_text() for p in sorted(ONBOARDING_DIR.glob("*.yaml"))}


def render(text: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The objects of a class for ``namespace`` (whose labels are ``labels``)."""
    tenant = labels.get(TENANT_LABEL) or namespace
    if not _LABEL_VALUE.match(tenant):
        raise OnboardingError(f"label {TENANT_LABEL}={tenant!r} is not a valid label value")
    quota = labels.get(GPU_QUOTA_LABEL, "0")
    if not quota.isdigit():
        raise OnboardingError(f"label {GPU_QUOTA_LABEL}={quota!r} must be a whole number of GPUs")
    try:
        rendered = string.Template(text).substitute(namespace=namespace, tenant=tenant, gpu_quota=quota)
        docs = [d for d in yaml.safe_load_all(rendered) if d]
    except (KeyError, ValueError, yaml.YAMLError) as exc:
        raise OnboardingError(f"the class does not render: {exc}") from exc
    for doc in docs:
        if "/" not in str(doc.get("apiVersion", "")) or not doc.get("kind") or not doc.get("metadata", {}).get("name"):
            raise OnboardingError(f"only objects of an API group with a name can be onboarded, not {doc!r:.120}")
        if doc["metadata"].get("namespace") not in (None, namespace):
            raise OnboardingError(f"{doc['kind']} {doc['metadata']['name']} names namespace "
                                  f"{doc['metadata']['namespace']!r}, not the one onboarded")
        doc["metadata"]["labels"] = {**doc["metadata"].get("labels", {}), **MANAGED_BY, TENANT_LABEL: tenant}
    return docs


def plural(kind: str) -> str:
    lower = kind.lower()
    return lower[:-1] + "ies" if lower.endswith("y") else lower + ("es" if lower.endswith("s") else "s")


class Onboarding:
    """Onboards labelled namespaces and collects the objects of tenants that are gone."""

    def __init__(self, api: Any, stop: threading.Event | None = None):
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.stop = stop or threading.Event()

    def install_classes(self, classes: Mapping[str, str] | None = None) -> list[str]:
        """Create (or update) the class ConfigMaps; returns their names."""
        from kubernetes import client

        try:
            self.core.create_namespace({"metadata": {"name": CLASSES_NAMESPACE, "labels": dict(MANAGED_BY)}})
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        names = []
        for name, text in (classes if classes is not None else shipped_classes()).items():
            body = {"metadata": {"name": class_configmap_name(name), "labels": dict(MANAGED_BY)},
                    "data": {CLASS_KEY: text}}
            try:
                self.core.create_namespaced_config_map(CLASSES_NAMESPACE, body)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
                self.core.replace_namespaced_config_map(body["metadata"]["name"], CLASSES_NAMESPACE, body)
            names.append(body["metadata"]["name"])
        return names

    def class_text(self, name: str) -> str:
        from kubernetes import client

        try:
            cm = self.core.read_namespaced_config_map(class_configmap_name(name), CLASSES_NAMESPACE)
        except client.ApiException as exc:
            if exc.status == 404:
                raise OnboardingError(f"no onboarding class {name!r} (ConfigMap {CLASSES_NAMESPACE}/"
                                      f"{class_configmap_name(name)})") from exc
            raise
        return (cm.data or {}).get(CLASS_KEY, "")

    def onboard(self, namespace: Any) -> None:
        """Create the objects of the namespace's class (those already there are kept)."""
        from kubernetes import client

        name, labels = namespace.metadata.name, namespace.metadata.labels or {}
        cls = labels[CLASS_LABEL]
        try:
            docs = render(self.class_text(cls), name, labels)
        except OnboardingError as exc:
            log.warning("namespace %s: %s", name, exc)
            self.core.patch_namespace(name, {"metadata": {"annotations": {ERROR_ANNOTATION: str(exc)}}})
            return
        for doc in docs:
            group, version = doc["apiVersion"].split("/")
            try:
                if doc["metadata"].get("namespace"):
                    self.custom.create_namespaced_custom_object(group, version, name, plural(doc["kind"]), doc)
                else:
                    self.custom.create_cluster_custom_object(group, version, plural(doc["kind"]), doc)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
        self.core.patch_namespace(name, {"metadata": {"annotations": {ONBOARDED_ANNOTATION: cls,
                                                                      ERROR_ANNOTATION: None}}})
        log.info("namespace %s onboarded (class %s, %d objects)", name, cls, len(docs))

    def reconcile(self) -> None:
        """Onboard every labelled namespace not yet onboarded; collect tenants that are gone."""
        namespaces = self.core.list_namespace(label_selector=CLASS_LABEL).items
        live_tenants = set()
        for ns in namespaces:
            if ns.status.phase != "Active":
                continue
            labels = ns.metadata.labels or {}
            live_tenants.add(labels.get(TENANT_LABEL) or ns.metadata.name)
            annotations = ns.metadata.annotations or {}
            if annotations.get(ONBOARDED_ANNOTATION) != labels[CLASS_LABEL] and ERROR_ANNOTATION not in annotations:
                self.onboard(ns)
        self.collect(live_tenants)

    def collect(self, live_tenants: set[str]) -> None:
        """Delete the ClusterQueues onboarding made for tenants without a namespace left."""
        from kubernetes import client

        managed = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        for cq in self.custom.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues",
                                                         label_selector=managed)["items"]:
            tenant = cq["metadata"]["labels"].get(TENANT_LABEL)
            if tenant not in live_tenants and not cq["metadata"].get("deletionTimestamp"):
                try:
                    self.custom.delete_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues",
                                                             cq["metadata"]["name"])
                    log.info("tenant %s has no namespace left: ClusterQueue %s deleted", tenant,
                             cq["metadata"]["name"])
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise

    def run(self) -> None:
        """Reconcile after every namespace change and every WATCH_S, until :attr:`stop` is set."""
        from kubernetes import watch

        while not self.stop.is_set():
            try:
                self.reconcile()
                w = watch.Watch()
                for _event in w.stream(self.core.list_namespace, label_selector=CLASS_LABEL,
                                       timeout_seconds=WATCH_S):
                    if self.stop.is_set():
                        break
                    self.reconcile()
                w.stop()
            except Exception as exc:  # noqa: BLE001 -- a controller keeps going; the next pass retries
                log.warning("onboarding pass failed (%s: %s); retrying in %ss", type(exc).__name__, exc, RETRY_S)
                self.stop.wait(RETRY_S)
