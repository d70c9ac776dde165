"""Platform names may contain '-': one platform's network namespaces are never another's."""
from __future__ import annotations

from clusters.embedded.podnet import _host
from clusters.embedded.podnet.network import PodNetwork

# A pod namespace of a platform the retired node agent ran (p + 10 hex digits): an older
# checkout's platform still comes down with its pods' namespaces.
AGENT_POD = "p0123456789"


def test_taking_down_a_leaves_the_namespaces_of_a_2(tmp_path, monkeypatch):
    """`relx` and `relx-2` side by side: `rayproof-relx-2-net` starts with
    `rayproof-relx-` too, and once went with `relx`'s teardown."""
    pod = f"rayproof-relx-{AGENT_POD}"
    present = ["rayproof-relx-net", pod, "rayproof-relx-k1", "rayproof-relx-out",
               "rayproof-relx-2-net", f"rayproof-relx-2-{AGENT_POD}", "rayproof-relx-2-k1",
               "rayproof-relx-2-out", "rayproof-relxx-net", "rayproof-relx-hub"]
    monkeypatch.setattr(_host, "list_netns", lambda prefix: sorted(n for n in present if n.startswith(prefix)))
    assert PodNetwork("relx", tmp_path).namespaces() == sorted(
        ["rayproof-relx-net", pod, "rayproof-relx-k1", "rayproof-relx-out"])
    assert PodNetwork("relx-2", tmp_path / "2").namespaces() == sorted(
        ["rayproof-relx-2-net", f"rayproof-relx-2-{AGENT_POD}", "rayproof-relx-2-k1", "rayproof-relx-2-out"])
