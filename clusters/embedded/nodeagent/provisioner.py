"""A dynamic provisioner for the embedded platform's ``rayproof-shared`` StorageClass.

Stands in for a ReadWriteMany network file system (EFS, Filestore, CephFS):
every claim of the class gets a PersistentVolume whose ``hostPath`` is one
directory on this machine, which every node (all nodes are this machine)
mounts, so checkpoints outlive pods and nodes as they would on shared
storage. It runs in the node agent, acting like an external provisioner:

* a Pending claim of the class without a volume gets a PV ``pvc-<claim uid>``
  pre-bound to it (``claimRef``); kube-controller-manager's PV controller
  binds the pair;
* a PV it made that turned ``Released`` (its claim was deleted) is deleted
  and its directory removed (reclaim policy ``Delete`` semantics; the PV
  itself says ``Retain`` because no in-tree plugin can delete a hostPath).
"""
from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from clusters.embedded.nodeagent.kube import ApiError, KubeClient

log = logging.getLogger(__name__)

STORAGE_CLASS = "rayproof-shared"
PROVISIONER = "rayproof.local/shared-dir"
MARK = "rayproof.io/provisioned-by"
RESYNC_S = 1.0


class SharedDirProvisioner:
    def __init__(self, api: KubeClient, root: Path):
        self.api = api
        self.root = Path(root)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shared-dir-provisioner", daemon=True)

    def start(self) -> None:
        self._thread.start()  # the root directory is made with the first volume

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.api.close()

    def _loop(self) -> None:
        # A controller's resync: Event.wait is the pause, stop() ends it at once.
        while not self._stop.wait(RESYNC_S):
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 - a controller keeps going; logged
                log.warning("shared-dir provisioner: %s", exc)

    def sync(self) -> None:
        claims = self.api.get("/api/v1/persistentvolumeclaims").get("items") or []
        for pvc in claims:
            spec, status = pvc.get("spec") or {}, pvc.get("status") or {}
            if spec.get("storageClassName") != STORAGE_CLASS or spec.get("volumeName") or status.get("phase") != "Pending":
                continue
            self._provision(pvc)
        for pv in self.api.get("/api/v1/persistentvolumes").get("items") or []:
            meta = pv.get("metadata") or {}
            if (meta.get("annotations") or {}).get(MARK) == PROVISIONER and (pv.get("status") or {}).get("phase") == "Released":
                self._delete(pv)

    def _provision(self, pvc: dict[str, Any]) -> None:
        meta = pvc["metadata"]
        path = self.root / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)
        size = ((pvc["spec"].get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        pv = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {MARK: PROVISIONER,
                                                                         "pv.kubernetes.io/provisioned-by": PROVISIONER}},
              "spec": {"capacity": {"storage": size}, "accessModes": pvc["spec"].get("accessModes") or ["ReadWriteMany"],
                       "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                       "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                       "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                                    "name": meta["name"], "uid": meta["uid"]}}}
        try:
            self.api.post("/api/v1/persistentvolumes", pv)
            log.info("provisioned %s for %s/%s at %s", pv["metadata"]["name"], meta["namespace"], meta["name"], path)
        except ApiError as exc:
            if not exc.conflict:
                raise

    def _delete(self, pv: dict[str, Any]) -> None:
        path = Path(((pv.get("spec") or {}).get("hostPath") or {}).get("path", ""))
        try:
            self.api.delete(f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
        except ApiError as exc:
            if not exc.not_found:
                raise
        if path.is_relative_to(self.root) and path != self.root:
            shutil.rmtree(path, ignore_errors=True)
