"""Export a verified evidence bundle to the Kubernetes AI Conformance program
(CNCF's ``k8s-ai-conformance``): the ``PRODUCT.yaml`` entries this suite has
evidence for, each pointing at its JUnit cases, plus a version-stamped
``e2e.log``; every other requirement of the checklist listed as not covered.

What the suite's clauses demonstrate maps onto two requirements of the
checklist:

- ``gang_scheduling``: Kueue admits a RayJob's gang all or nothing (ADM-1,
  ADM-2), waits for a late worker without splitting the gang (ADM-3), evicts
  and requeues a gang that never gets Ready (ADM-4), preempts whole gangs
  (ADM-5);
- ``robust_controller``: the KubeRay operator reconciles RayJobs, RayServices
  and RayClusters through faults (TRN-1, TRN-2, GCS-1, GCS-2, OPS-1), every
  one of them admitted through Kueue's webhooks.

An entry is ``Implemented`` only where every clause that evidences it ran and
passed in the bundle; otherwise its status is left empty for the vendor, its
notes naming the clauses that failed or did not run. The suite never claims
a requirement it has no evidence for: those are listed with an empty status.
The checklist's descriptions and metadata are the vendor's to fill from the
program's template for their Kubernetes version; the entries here merge into
it by ``id``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reports import bundle as bundle_mod

# The requirement ids of each checklist version, by section, with their level
# (the program's docs/AIConformance-<version> files).
CHECKLISTS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "v1.35": {
        "accelerators": [("dra_support", "MUST"), ("driver_runtime_management", "SHOULD"),
                         ("gpu_sharing", "SHOULD"), ("virtualized_accelerator", "SHOULD")],
        "networking": [("ai_inference", "MUST")],
        "schedulingOrchestration": [("gang_scheduling", "MUST"), ("cluster_autoscaling", "MUST"),
                                    ("pod_autoscaling", "MUST")],
        "observability": [("accelerator_metrics", "MUST"), ("ai_service_metrics", "MUST")],
        "security": [("secure_accelerator_access", "MUST")],
        "operator": [("robust_controller", "MUST")],
    },
    "v1.37": {
        "accelerators": [("driver_runtime_management", "SHOULD"), ("gpu_sharing", "SHOULD"),
                         ("virtualized_accelerator", "SHOULD")],
        "networking": [("ai_inference", "MUST"), ("advanced_inference_ingress", "SHOULD"),
                       ("high_performance_networking", "SHOULD"), ("disaggregated_inference", "SHOULD")],
        "schedulingOrchestration": [("gang_scheduling", "MUST"), ("cluster_autoscaling", "MUST"),
                                    ("pod_autoscaling", "MUST")],
        "observability": [("accelerator_metrics", "MUST"), ("ai_service_metrics", "MUST")],
        "security": [("secure_accelerator_access", "MUST"), ("workload_sandboxing", "SHOULD")],
        "operator": [("robust_controller", "MUST")],
    },
}

# The requirements the suite has evidence for: the clauses that evidence
# each, and what they show.
COVERED: dict[str, tuple[tuple[str, ...], str]] = {
    "gang_scheduling": (("ADM-1", "ADM-2", "ADM-3", "ADM-4", "ADM-5"),
                        "Kueue {kueue} admits KubeRay RayJobs as whole gangs: a gang that does not fit waits "
                        "suspended with no pods (ADM-1), teams over capacity never hold partial gangs (ADM-2), a late "
                        "worker is waited for without splitting the gang (ADM-3), a gang that never gets Ready is "
                        "evicted and requeued within waitForPodsReady (ADM-4), a higher-priority job preempts a whole "
                        "gang which resumes from its checkpoint (ADM-5)."),
    "robust_controller": (("TRN-1", "TRN-2", "GCS-1", "GCS-2", "OPS-1"),
                          "The KubeRay operator {kuberay} (CRDs RayJob, RayCluster, RayService) reconciles through "
                          "faults: a training RayJob survives a preempted worker (TRN-1) and a lost head (TRN-2) "
                          "from its checkpoint, a RayService keeps serving through its head's OOM kill and recovers "
                          "(GCS-1, GCS-2), a finished RayJob's cluster is torn down and its GPUs returned (OPS-1); "
                          "every object admitted through Kueue's webhooks."),
}
EVIDENCE_DIR = "results"


class ExportError(ValueError):
    """The bundle cannot be exported (it does not verify, or no checklist for its version)."""


@dataclass
class Export:
    product: dict[str, Any]
    e2e_log: str
    junit: bytes
    covered: dict[str, str]  # requirement id -> status ("Implemented" or "")


def build(bundle: Path, checklist: str | None = None) -> Export:
    """The export of a bundle that verifies; ``checklist`` defaults to the
    bundle's Kubernetes minor version."""
    members = bundle_mod.read(bundle)
    problems, summary = bundle_mod.verify(bundle, members)
    if problems:
        raise ExportError(f"{bundle} does not verify ({problems[0]}); run `rayproof verify {bundle}` and export "
                          "only a bundle that verifies")
    results = json.loads(members["results.json"])
    versions = json.loads(members.get(bundle_mod.VERSIONS) or b"{}")
    platform = versions.get("platform") or {}
    kubernetes = str(platform.get("kubernetes") or "")
    version = checklist or ".".join(kubernetes.split(".")[:2])
    if version not in CHECKLISTS:
        raise ExportError(f"no Kubernetes AI Conformance checklist {version or '(unknown version)'} known to this "
                          f"suite (known: {', '.join(CHECKLISTS)}); pass --checklist with one of them")
    by_clause: dict[str, list[dict[str, Any]]] = {}
    for row in results.get("results") or []:
        by_clause.setdefault(row.get("clause") or "", []).append(row)
    spec: dict[str, list[dict[str, Any]]] = {}
    covered: dict[str, str] = {}
    for section, requirements in CHECKLISTS[version].items():
        spec[section] = []
        for rid, level in requirements:
            entry: dict[str, Any] = {"id": rid, "level": level}
            if rid in COVERED:
                clauses, shows = COVERED[rid]
                entry.update(_covered_entry(clauses, shows.format(**{k: platform.get(k, "?") for k in
                                                                     ("kueue", "kuberay")}), by_clause))
                covered[rid] = entry["status"]
            else:
                entry.update(status="", evidence=[],
                             notes=f"not covered: rayproof has no clause that evidences {rid}")
            spec[section].append(entry)
    product = {
        "metadata": {"kubernetesVersion": version, "platformName": "[Platform Name]",
                     "platformVersion": "[Platform Version]", "vendorName": "[Vendor Name]"},
        "spec": spec,
    }
    return Export(product, _e2e_log(bundle, version, summary, results, versions), members.get("junit.xml", b""),
                  covered)


def write(export: Export, out: Path) -> list[Path]:
    """Write ``PRODUCT.yaml`` and ``results/{junit.xml,e2e.log}`` under ``out``."""
    (out / EVIDENCE_DIR).mkdir(parents=True, exist_ok=True)
    header = ("# Kubernetes AI Conformance entries written by `rayproof export cncf-ai` from a verified evidence "
              "bundle.\n# Merge them by id into the program's PRODUCT.yaml template for this Kubernetes version and "
              "fill in its metadata;\n# an empty status is not a claim: the bundle has no passing evidence for it.\n")
    written = [out / "PRODUCT.yaml", out / EVIDENCE_DIR / "junit.xml", out / EVIDENCE_DIR / "e2e.log"]
    written[0].write_text(header + yaml.safe_dump(export.product, sort_keys=False, width=110))
    written[1].write_bytes(export.junit)
    written[2].write_text(export.e2e_log)
    return written


def _covered_entry(clauses: tuple[str, ...], shows: str, by_clause: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = [row for clause in clauses for row in by_clause.get(clause, [])]
    failed = sorted({r["clause"] for r in rows if r.get("outcome") != "passed"})
    missing = [c for c in clauses if c not in by_clause]
    evidence = [f"file://{EVIDENCE_DIR}/junit.xml#{_junit_case(r['nodeid'])}" for r in rows]
    evidence.append(f"file://{EVIDENCE_DIR}/e2e.log")
    if failed or missing:
        gaps = "; ".join(part for part in (failed and f"failed: {', '.join(failed)}",
                                           missing and f"did not run: {', '.join(missing)}") if part)
        return {"status": "", "evidence": evidence,
                "notes": f"no claim: this bundle's evidence is incomplete ({gaps}). What the clauses show when they "
                         f"pass: {shows}"}
    return {"status": "Implemented", "evidence": evidence, "notes": shows}


def _junit_case(nodeid: str) -> str:
    """pytest's JUnit name of a test: its module's dotted path, then the test."""
    module, _, test = nodeid.partition("::")
    return f"{module.removesuffix('.py').replace('/', '.')}.{test.replace('::', '.')}"


def _e2e_log(bundle: Path, version: str, summary: dict[str, Any], results: dict[str, Any],
             versions: dict[str, Any]) -> str:
    def stamp(epoch: Any) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(epoch))) if epoch else "?"

    platform, runner = versions.get("platform") or {}, versions.get("runner") or {}
    lines = [
        f"rayproof suite commit {versions.get('suite_commit', '?')}: Kubernetes AI Conformance evidence "
        f"(checklist {version})",
        f"bundle {bundle.name} sha256 {bundle_mod.sha256_of(bundle)}",
        f"verdict {summary.get('verdict', '?')}",
        "platform " + ", ".join(f"{k} {v}" for k, v in sorted(platform.items())),
        "runner " + ", ".join(f"{k} {v}" for k, v in sorted(runner.items())),
        f"started {stamp(results.get('started'))} finished {stamp(results.get('finished'))}",
    ]
    wanted = {clause: rid for rid, (clauses, _) in COVERED.items() for clause in clauses}
    for row in results.get("results") or []:
        rid = wanted.get(row.get("clause") or "", "-")
        lines.append(f"{str(row.get('outcome', '?')).upper():7} {row.get('clause') or '-':6} {rid:18} "
                     f"{row.get('duration_s', 0):8.1f}s {row['nodeid']}")
    return "\n".join(lines) + "\n"
