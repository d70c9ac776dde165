"""Signed bundles (reports/attestation.py): an in-toto statement in a DSSE envelope."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from rayproof import cli
from reports import attestation

SUMMARY = {"verdict": "CERTIFIED", "verdict_reason": "every clause passed",
           "clauses": [{"id": "NET-3", "outcome": "passed"}], "platform": {"kubernetes": "v1.35.4"}}


def _keys(tmp_path: Path, private_key, name: str) -> tuple[Path, Path]:
    priv, pub = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
    priv.write_bytes(private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    pub.write_bytes(private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


@pytest.mark.parametrize("make", [ed25519.Ed25519PrivateKey.generate, lambda: ec.generate_private_key(ec.SECP256R1()),
                                  lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048)],
                         ids=["ed25519", "ecdsa-p256", "rsa-pss"])
def test_a_signed_bundle_verifies_and_a_changed_one_does_not(tmp_path, make):
    bundle = tmp_path / "certification-x.tar.gz"
    bundle.write_bytes(b"the bundle's bytes")
    priv, pub = _keys(tmp_path, make(), "signer")
    envelope = attestation.sign(bundle, priv, SUMMARY)
    assert envelope.name == "certification-x.tar.gz.intoto.jsonl"
    assert attestation.verify(bundle, envelope, pub, SUMMARY) == []
    statement = json.loads(base64.b64decode(json.loads(envelope.read_text())["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"][0]["name"] == bundle.name and statement["predicate"]["verdict"] == "CERTIFIED"

    # A forger re-packs the bundle (its manifest recomputed): the signed digest no longer matches.
    bundle.write_bytes(b"the bundle's bytes, edited")
    assert "is not the one that was signed" in attestation.verify(bundle, envelope, pub, SUMMARY)[0]
    # ... and cannot sign again without the private key: another key's signature does not verify.
    other_priv, _ = _keys(tmp_path, ed25519.Ed25519PrivateKey.generate(), "forger")
    forged = attestation.sign(bundle, other_priv, SUMMARY)
    assert "no signature verifies" in attestation.verify(bundle, forged, pub, SUMMARY)[0]


def test_a_statement_whose_certificate_differs_from_the_bundles_fails(tmp_path):
    bundle = tmp_path / "b.tar.gz"
    bundle.write_bytes(b"x")
    priv, pub = _keys(tmp_path, ed25519.Ed25519PrivateKey.generate(), "k")
    envelope = attestation.sign(bundle, priv, {**SUMMARY, "verdict": "NOT CERTIFIED"})
    assert "is not the one the bundle's results make (CERTIFIED)" in attestation.verify(bundle, envelope, pub,
                                                                                         SUMMARY)[0]
    assert "does not exist" in attestation.verify(bundle, tmp_path / "none.jsonl", pub, SUMMARY)[0]
    (tmp_path / "junk.jsonl").write_text("{not json")
    assert "is not a DSSE envelope" in attestation.verify(bundle, tmp_path / "junk.jsonl", pub, SUMMARY)[0]


def test_pae_is_dsse_v1():
    assert attestation.pae("application/vnd.in-toto+json", b"hello") == b"DSSEv1 28 application/vnd.in-toto+json 5 hello"


def test_certify_with_a_key_it_cannot_use_is_bad_input_before_anything(tmp_path, capsys):
    (tmp_path / "key.pem").write_text("not a key")
    rc = cli.main(["certify", "--sign-key", str(tmp_path / "key.pem"), "--out", str(tmp_path / "out")])
    assert rc == cli.BAD_INPUT_EXIT and "not an unencrypted PEM private key" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
