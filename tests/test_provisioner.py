"""The StorageClasses' provisioner (clusters/embedded/nodes/provisioner.py) without an API server: what
it makes for a claim of each class, on this machine and in each node's own /var/lib, and what it removes
once a volume it made is released; and the kubeconfig its small API client reads."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from clusters.embedded.nodes import kube
from clusters.embedded.nodes.provisioner import (
    MARK,
    NODE_LOCAL_CLASS,
    NODE_LOCAL_PATH,
    PROVISIONERS,
    SHARED_CLASS,
    DirectoryProvisioner,
)


class FakeApi:
    """The API calls the provisioner makes, answered from lists."""

    def __init__(self, claims: list[dict], volumes: list[dict]) -> None:
        self.claims, self.volumes = claims, volumes
        self.created: list[dict] = []
        self.deleted: list[str] = []

    def get(self, path: str, **params: Any) -> Any:
        return {"items": {"/api/v1/persistentvolumeclaims": self.claims,
                          "/api/v1/persistentvolumes": self.volumes}[path]}

    def post(self, path: str, body: Any, **params: Any) -> Any:
        assert path == "/api/v1/persistentvolumes"
        if any(v["metadata"]["name"] == body["metadata"]["name"] for v in self.created):
            raise kube.ApiError(409, "POST", path, '{"reason": "AlreadyExists"}')
        self.created.append(body)
        return body

    def delete(self, path: str, body: Any = None, **params: Any) -> Any:
        self.deleted.append(path)

    def close(self) -> None:
        pass


def claim(name: str, storage_class: str, **status: Any) -> dict:
    return {"metadata": {"namespace": "team-a", "name": name, "uid": f"{name}-0123456789"},
            "spec": {"storageClassName": storage_class, "accessModes": ["ReadWriteMany"],
                     "resources": {"requests": {"storage": "2Gi"}}},
            "status": {"phase": "Pending", **status}}


def test_a_shared_claim_gets_one_directory_and_a_node_local_claim_one_in_every_node(tmp_path: Path) -> None:
    nodes = [tmp_path / "n1" / "var-lib", tmp_path / "n2" / "var-lib"]
    api = FakeApi([claim("ckpt", SHARED_CLASS), claim("scratch", NODE_LOCAL_CLASS),
                   claim("other", "standard"), claim("bound", SHARED_CLASS, phase="Bound")], [])
    provisioner = DirectoryProvisioner(api, tmp_path / "pvc", node_var_libs=nodes)  # type: ignore[arg-type]
    provisioner.sync()
    by_class = {pv["spec"]["storageClassName"]: pv for pv in api.created}
    assert set(by_class) == {SHARED_CLASS, NODE_LOCAL_CLASS}, "only Pending claims of its own classes"
    shared, local = by_class[SHARED_CLASS], by_class[NODE_LOCAL_CLASS]
    assert shared["spec"]["hostPath"]["path"] == str(tmp_path / "pvc" / "team-a" / "ckpt-ckpt-012")
    assert (tmp_path / "pvc" / "team-a" / "ckpt-ckpt-012").is_dir()
    local_path = Path(local["spec"]["hostPath"]["path"])
    assert local_path == NODE_LOCAL_PATH / "team-a" / "scratch-scratch-"
    for var_lib in nodes:  # each node's own directory at that path, writable by Ray's uid 1000
        made = var_lib / local_path.relative_to("/var/lib")
        assert made.is_dir() and made.stat().st_mode & 0o777 == 0o777
    assert local["spec"]["claimRef"]["uid"] == "scratch-0123456789"
    assert local["metadata"]["annotations"][MARK] == PROVISIONERS[NODE_LOCAL_CLASS]
    assert shared["spec"]["capacity"] == {"storage": "2Gi"}
    provisioner.sync()  # a claim not yet bound is provisioned again: the API server's conflict is no error
    assert len(api.created) == 2


def test_a_released_volume_it_made_is_deleted_with_its_directories(tmp_path: Path) -> None:
    nodes = [tmp_path / "n1" / "var-lib", tmp_path / "n2" / "var-lib"]
    api = FakeApi([claim("scratch", NODE_LOCAL_CLASS), claim("ckpt", SHARED_CLASS)], [])
    provisioner = DirectoryProvisioner(api, tmp_path / "pvc", node_var_libs=nodes)  # type: ignore[arg-type]
    provisioner.sync()
    api.claims = []
    api.volumes = [{**pv, "status": {"phase": "Released"}} for pv in api.created]
    api.volumes.append({"metadata": {"name": "someone-elses"}, "status": {"phase": "Released"},
                        "spec": {"hostPath": {"path": str(tmp_path / "keep")}}})
    (tmp_path / "keep").mkdir()
    provisioner.sync()
    assert sorted(api.deleted) == sorted(f"/api/v1/persistentvolumes/{pv['metadata']['name']}" for pv in api.created)
    assert not (tmp_path / "pvc" / "team-a" / "ckpt-ckpt-012").exists()
    assert not any((n / "rayproof-node-local" / "team-a" / "scratch-scratch-").exists() for n in nodes)
    assert (tmp_path / "keep").is_dir(), "a volume it did not make is left alone"


def test_the_client_reads_a_kubeconfigs_inline_certificates_into_private_files(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "current-context": "admin",
        "contexts": [{"name": "admin", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443/",
                                                "certificate-authority-data": base64.b64encode(b"CA").decode()}}],
        "users": [{"name": "u", "user": {"client-certificate": "u.crt",
                                          "client-key-data": base64.b64encode(b"KEY").decode()}}]}))
    creds = kube.load_kubeconfig(config, tmp_path / "creds")
    assert creds.server == "https://127.0.0.1:6443"
    assert Path(creds.ca_file or "").read_bytes() == b"CA"
    assert creds.cert_file == str(tmp_path / "u.crt"), "a relative path is the kubeconfig's directory's"
    key = Path(creds.key_file or "")
    assert key.read_bytes() == b"KEY" and key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "creds").stat().st_mode & 0o777 == 0o700
