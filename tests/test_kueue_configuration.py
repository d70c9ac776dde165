"""Kueue's live waitForPodsReady read from its ConfigMap, and compared with what the profile promises."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import yaml
from kubernetes import client

from core import kueue


def _reading(monkeypatch, config=None, status=None):
    def read(self, name, namespace):
        assert (name, namespace) == (kueue.CONFIG_MAP, kueue.CONFIG_NAMESPACE)
        if status:
            raise client.ApiException(status=status, reason="Forbidden")
        return NS(data={kueue.CONFIG_KEY: yaml.safe_dump(config)})
    monkeypatch.setattr(client.CoreV1Api, "read_namespaced_config_map", read)


V1BETA2 = {"apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
           "waitForPodsReady": {"timeout": "4m", "requeuingStrategy": {"backoffBaseSeconds": 10}}}


def test_a_configuration_that_keeps_the_promise(monkeypatch):
    _reading(monkeypatch, V1BETA2)
    seen = kueue.configured_wait_for_pods_ready(None)
    assert (seen["enabled"], seen["timeout_s"], seen["backoff_base_s"]) == (True, 240.0, 10.0)
    assert kueue.promise_disagreements(seen, 240, 10) == []


@pytest.mark.parametrize(("config", "words"), [
    ({**V1BETA2, "waitForPodsReady": {"timeout": "4m", "requeuingStrategy": {"backoffBaseSeconds": 150}}},
     "backoffBaseSeconds 150 s, the profile promises backoffBase 10 s"),
    ({"apiVersion": "config.kueue.x-k8s.io/v1beta2"}, "has waitForPodsReady off"),
    ({"apiVersion": "config.kueue.x-k8s.io/v1beta1", "waitForPodsReady": {"enable": False, "timeout": "4m"}},
     "has waitForPodsReady off"),
    ({**V1BETA2, "waitForPodsReady": {"timeout": "20s"}}, "timeout 20 s, the profile promises 240 s"),
])
def test_a_configuration_that_breaks_it(monkeypatch, config, words):
    _reading(monkeypatch, config)
    found = kueue.promise_disagreements(kueue.configured_wait_for_pods_ready(None), 240, 10)
    assert any(words in f for f in found), found


def test_a_configuration_it_may_not_read_is_taken_on_trust(monkeypatch):
    _reading(monkeypatch, status=403)
    seen = kueue.configured_wait_for_pods_ready(None)
    assert seen["source"] is None and "403" in seen["why"]
    assert kueue.promise_disagreements(seen, 240, 10) == []
