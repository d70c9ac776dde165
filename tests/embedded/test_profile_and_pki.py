"""The embedded platform's profile validation and certificates, without processes.

Fast checks of what the control plane relies on: a bad profile is refused
with one message naming the field and what is allowed, and the PKI issues
the identities and SANs the API server, the components and the nodes' kubelets need.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from clusters.embedded.pki import APISERVER_DNS_SANS, FIRST_SERVICE_IP, ensure_pki
from clusters.embedded.profile import ProfileError, load_profile, parse_duration


def test_default_profile_is_valid_and_documented_values_hold() -> None:
    p = load_profile()
    assert p.node_count == 4
    assert p.node_shape == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "8"}
    wfpr = p.kueue["waitForPodsReady"]
    assert parse_duration(wfpr["timeout"]) == 240
    assert set(p.kueue["integrations"]) >= {"ray.io/rayjob", "ray.io/raycluster", "batch/job"}


def test_user_profile_merges_over_defaults(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("nodes: {count: 2, shape: {nvidia.com/gpu: 1}}\nkueue: {waitForPodsReady: {timeout: 1m30s}}\n")
    p = load_profile(f)
    assert p.node_count == 2
    assert p.node_shape == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert p.kueue["waitForPodsReady"]["timeout"] == "1m30s"
    assert p.kueue["waitForPodsReady"]["requeuingStrategy"]["backoffBaseSeconds"] == 10
    assert p.digest() != load_profile().digest()


@pytest.mark.parametrize(("override", "field", "allowed"), [
    ({"nodes": {"count": 0}}, "nodes.count", "an integer from 1 to 16"),
    ({"nodes": {"cuont": 3}}, "nodes.cuont", "allowed here: count, runtime, shape"),
    ({"nodes": {"runtime": "agent"}}, "nodes.runtime", "kubelet (the project's node agent retired (issue 39)"),
    ({"nodes": {"shape": {"memory": "4GB"}}}, "nodes.shape.memory", "Kubernetes quantity"),
    ({"kueue": {"waitForPodsReady": {"timeout": "2 minutes"}}}, "kueue.waitForPodsReady.timeout", "Go duration"),
    ({"kueue": {"waitForPodsReady": {"requeuingStrategy": {"timestamp": "Now"}}}},
     "kueue.waitForPodsReady.requeuingStrategy.timestamp", "one of Eviction, Creation"),
    ({"kueue": {"waitForPodsReady": {"requeuingStrategy": {"backoffMaxSeconds": 5}}}},
     "kueue.waitForPodsReady.requeuingStrategy.backoffMaxSeconds", ">= backoffBaseSeconds"),
    ({"kueue": {"integrations": ["kubeflow.org/mpijob"]}}, "kueue.integrations", "ray.io/rayjob"),
    ({"kuberay": {"featureGates": {"RayJobDeletionPolicy": "yes"}}}, "kuberay.featureGates", "true/false"),
    ({"kuberay": {"upgradeCRDs": "replace"}}, "kuberay.upgradeCRDs", "one of apply, recreate"),
    ({"kuberay": {"upgradeWatchNamespaces": "kuberay-system"}}, "kuberay.upgradeWatchNamespaces",
     "a non-empty list of namespace names"),
])
def test_bad_profile_names_field_and_what_is_allowed(override: dict[str, Any], field: str, allowed: str) -> None:
    with pytest.raises(ProfileError) as err:
        load_profile(override)
    message = str(err.value)
    assert f"field {field}:" in message and allowed in message, message


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(ext.get_values_for_type(x509.DNSName)), {str(i) for i in ext.get_values_for_type(x509.IPAddress)}


def test_pki_issues_what_the_control_plane_and_node_agents_need(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    ca = _cert(pki.ca_file)

    api = _cert(pki.apiserver.cert)
    api.verify_directly_issued_by(ca)
    dns, ips = _sans(api)
    assert set(APISERVER_DNS_SANS) <= dns and {"127.0.0.1", FIRST_SERVICE_IP} <= ips, (dns, ips)
    assert ipaddress.ip_address(FIRST_SERVICE_IP) == next(ipaddress.ip_network("198.19.0.0/16").hosts())

    admin = _cert(pki.admin.cert)
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    eku = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in eku and ExtendedKeyUsageOID.SERVER_AUTH not in eku

    node = pki.issue_node("node-1", ["198.18.0.11"])
    client = _cert(node.client.cert)
    assert client.subject.rfc4514_string() == "CN=system:node:node-1,O=system:nodes"
    dns, ips = _sans(_cert(node.serving.cert))
    assert dns == {"node-1", "localhost"} and ips == {"127.0.0.1", "198.18.0.11"}

    webhook = pki.webhook_serving("tls", "kueue-webhook-service", tmp_path / "wh")
    assert _sans(_cert(webhook.cert))[1] == {"127.0.0.1"}
    assert (tmp_path / "wh" / "tls.key").stat().st_mode & 0o077 == 0

    # A second load keeps every identity (a restarted control plane keeps tokens valid).
    again = ensure_pki(tmp_path / "pki")
    assert again.admin.cert.read_bytes() == pki.admin.cert.read_bytes()
    assert again.sa_private.read_bytes() == pki.sa_private.read_bytes()
    # A node re-issued with another address gets a new serving certificate.
    moved = pki.issue_node("node-1", ["198.18.0.12"])
    assert "198.18.0.12" in _sans(_cert(moved.serving.cert))[1]
