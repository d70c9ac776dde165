"""The real nodes' kubelet configuration, checked without a kubelet: what the profile's node shape becomes."""
from __future__ import annotations

from pathlib import Path

import yaml

from clusters.embedded.nodes.node import Node, system_reserved

GIB = 2**30


def test_a_shape_smaller_than_the_machine_is_reserved_down_to_with_the_eviction_threshold_counted_in() -> None:
    reserved, short = system_reserved({"cpu": "4", "memory": "16Gi"}, cpus=8, memory_bytes=24 * GIB)
    # allocatable = capacity - systemReserved - evictionHard memory.available (100Mi) = 16Gi, 4 CPUs
    assert reserved == {"cpu": "4000m", "memory": f"{8 * 1024 - 100}Mi"}
    assert short == []


def test_what_the_machine_lacks_is_named_and_not_reserved() -> None:
    reserved, short = system_reserved({"cpu": "4", "memory": "16Gi"}, cpus=2, memory_bytes=24 * GIB)
    assert reserved == {"memory": f"{8 * 1024 - 100}Mi"}
    assert short == ["cpu 4 (the machine has 2)"]
    reserved, short = system_reserved({"cpu": "500m", "memory": "32Gi"}, cpus=2, memory_bytes=24 * GIB)
    assert reserved == {"cpu": "1500m"}
    assert short == ["memory 32Gi (the machine has 24.0Gi)"]


def test_a_shape_equal_to_the_machine_or_silent_on_a_resource_reserves_nothing() -> None:
    assert system_reserved({"cpu": "2"}, cpus=2, memory_bytes=24 * GIB) == ({}, [])
    assert system_reserved({"nvidia.com/gpu": "8"}, cpus=2, memory_bytes=24 * GIB) == ({}, [])


def test_the_reservation_is_in_kubelets_configuration_and_absent_when_empty(tmp_path: Path) -> None:
    node = Node("p", 1, "rayproof-node-1", tmp_path, tmp_path)
    files = dict(ca_file=tmp_path / "ca.crt", serving_cert=tmp_path / "s.crt", serving_key=tmp_path / "s.key")
    cfg = yaml.safe_load(node._kubelet_yaml(**files, reserved={"memory": "8092Mi"}))
    assert cfg["systemReserved"] == {"memory": "8092Mi"}
    assert cfg["evictionHard"]["memory.available"] == "100Mi"
    assert "systemReserved" not in yaml.safe_load(node._kubelet_yaml(**files, reserved={}))
