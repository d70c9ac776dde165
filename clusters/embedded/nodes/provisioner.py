"""A dynamic provisioner for the embedded platform's two StorageClasses.

* ``rayproof-shared`` (the default) stands in for a ReadWriteMany network file
  system (EFS, Filestore, CephFS): every claim of the class gets a
  PersistentVolume whose ``hostPath`` is one directory on this machine, which
  every node (all nodes are this machine) mounts, so checkpoints outlive pods
  and nodes as they would on shared storage.
* ``rayproof-node-local`` stands in for a node's own disk (a hostPath or
  local-disk provisioner without node affinity): the claim's PV names one
  path, and each node that mounts it sees its own directory there, so what a
  pod writes is visible only to pods on the same node. It is there to
  certify that a clause catches checkpoints on storage that is not shared
  (TRN-2's self-test); no default uses it.

It is a process of the platform (:func:`main`, started by ``layer.py``),
acting like an external provisioner, and kubelet mounts the PVs'
``hostPath`` as any kubelet does. A node-local PV's path is under
``/var/lib``, which each node's mount namespace binds to the node's own
directory (``node.py``), so each node sees its own; the provisioner makes
the directory in every node, writable by any user (Ray's image runs as uid
1000), as a local-path provisioner does. (It ran in the project's node
agent before that retired, issue 39.)

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

from clusters.embedded.nodes.kube import ApiError, KubeClient

log = logging.getLogger(__name__)

SHARED_CLASS = "rayproof-shared"
NODE_LOCAL_CLASS = "rayproof-node-local"
# StorageClass -> the provisioner name it carries in baseline.yaml
PROVISIONERS = {SHARED_CLASS: "rayproof.local/shared-dir", NODE_LOCAL_CLASS: "rayproof.local/node-dir"}
MARK = "rayproof.io/provisioned-by"
RESYNC_S = 1.0


NODE_LOCAL_PATH = Path("/var/lib/rayproof-node-local")  # a node-local PV's path, each node's own


class DirectoryProvisioner:
    def __init__(self, api: KubeClient, root: Path, node_var_libs: list[Path]):
        """``root``: where the shared class's volumes are made; ``node_var_libs``: each node's own
        ``/var/lib`` on this machine, where a node-local volume is made once per node."""
        self.api = api
        self.root = Path(root)
        self.node_var_libs = node_var_libs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="directory-provisioner", daemon=True)

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
                log.warning("directory provisioner: %s", exc)

    def sync(self) -> None:
        claims = self.api.get("/api/v1/persistentvolumeclaims").get("items") or []
        for pvc in claims:
            spec, status = pvc.get("spec") or {}, pvc.get("status") or {}
            if spec.get("storageClassName") not in PROVISIONERS or spec.get("volumeName") or status.get("phase") != "Pending":
                continue
            self._provision(pvc)
        for pv in self.api.get("/api/v1/persistentvolumes").get("items") or []:
            meta = pv.get("metadata") or {}
            if (meta.get("annotations") or {}).get(MARK) in PROVISIONERS.values() \
                    and (pv.get("status") or {}).get("phase") == "Released":
                self._delete(pv)

    def _node_dirs(self, path: Path) -> list[Path]:
        """Where a node's PV path ``path`` (under ``NODE_LOCAL_PATH``) is on this machine, per node."""
        return [var_lib / path.relative_to("/var/lib") for var_lib in self.node_var_libs]

    def _provision(self, pvc: dict[str, Any]) -> None:
        meta = pvc["metadata"]
        storage_class = pvc["spec"]["storageClassName"]
        relative = Path(meta["namespace"]) / f"{meta['name']}-{meta['uid'][:8]}"
        if storage_class == NODE_LOCAL_CLASS:
            path = NODE_LOCAL_PATH / relative
            made = self._node_dirs(path)
        else:
            path = self.root / relative
            made = [path]
        for directory in made:
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o777)
        size = ((pvc["spec"].get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        provisioner = PROVISIONERS[storage_class]
        pv = {"apiVersion": "v1", "kind": "PersistentVolume",
              "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {MARK: provisioner,
                                                                         "pv.kubernetes.io/provisioned-by": provisioner}},
              "spec": {"capacity": {"storage": size}, "accessModes": pvc["spec"].get("accessModes") or ["ReadWriteMany"],
                       "persistentVolumeReclaimPolicy": "Retain", "storageClassName": storage_class,
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
        elif path.is_relative_to(NODE_LOCAL_PATH) and path != NODE_LOCAL_PATH:
            for directory in self._node_dirs(path):
                shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """The provisioner as a process of the platform."""
    import argparse
    import signal

    from clusters.embedded.nodes.kube import load_kubeconfig

    ap = argparse.ArgumentParser(prog="python -m clusters.embedded.nodes.provisioner",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--kubeconfig", type=Path, required=True)
    ap.add_argument("--root", type=Path, required=True, help="where the shared class's volumes are made")
    ap.add_argument("--node-var-lib", type=Path, action="append", default=[], required=True,
                    help="a node's own /var/lib directory (repeatable)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    creds = load_kubeconfig(args.kubeconfig, args.root / ".creds")
    provisioner = DirectoryProvisioner(KubeClient(creds, user_agent="rayproof-provisioner"), args.root,
                                       node_var_libs=args.node_var_lib)
    provisioner.start()
    stopped.wait()
    provisioner.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
