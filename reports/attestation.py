"""A bundle bound to who made it: an in-toto statement in a DSSE envelope.

``certify --sign-key KEY`` writes, beside the evidence bundle,
``<bundle>.intoto.jsonl``: one line, a DSSE envelope
(https://github.com/secure-systems-lab/dsse) whose payload is an in-toto
Statement v1 (https://in-toto.io/Statement/v1) naming the bundle file and its
sha256 as the subject, with the certificate's verdict, reason, clause
outcomes and platform as the predicate. The signature is over DSSE's
pre-authentication encoding, made with the ``cryptography`` library
(Ed25519, ECDSA P-256/P-384 with SHA-256/384, or RSA-PSS with SHA-256; PEM
keys, unencrypted). Supply-chain tools that read DSSE (``cosign
verify-blob-attestation``, in-toto) read it.

``verify BUNDLE --key PUB`` checks the signature with the public key, that
the subject's digest is the bundle's, and that the predicate is the
certificate the bundle's own results make: a bundle edited and re-packed
with its manifest recomputed no longer matches its signed digest, and
nobody without the private key can sign it again.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from reports.bundle import sha256_of

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://github.com/rayproof/rayproof/certification/v1"
SUFFIX = ".intoto.jsonl"


class BadKey(ValueError):
    """A key file that cannot be used (missing, not PEM, encrypted, an unsupported algorithm)."""


def envelope_path(bundle: Path) -> Path:
    return bundle.with_name(bundle.name + SUFFIX)


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding: what is signed."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _load_key(path: Path, private: bool) -> Any:
    """A PEM key of a kind this module signs with (Ed25519, ECDSA, RSA); :class:`BadKey` otherwise."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    option, what = ("--sign-key", "an unencrypted PEM private key") if private else ("--key", "a PEM public key")
    try:
        data = Path(path).read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (OSError, ValueError, TypeError) as exc:
        raise BadKey(f"{option} {path}: not {what} ({exc})") from None
    kinds = ((ed25519.Ed25519PrivateKey, ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey) if private
             else (ed25519.Ed25519PublicKey, ec.EllipticCurvePublicKey, rsa.RSAPublicKey))
    if not isinstance(key, kinds):
        raise BadKey(f"{option} {path}: a {type(key).__name__}; use Ed25519, ECDSA or RSA")
    return key


def load_private_key(path: Path) -> Any:
    return _load_key(path, private=True)


def load_public_key(path: Path) -> Any:
    return _load_key(path, private=False)


def key_id(public_key: Any) -> str:
    """The sha256 of the public key's DER (SubjectPublicKeyInfo), hex."""
    from cryptography.hazmat.primitives import serialization

    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _hash_for(key: Any) -> Any:
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA384() if getattr(key, "curve", None) is not None and key.curve.key_size >= 384 else hashes.SHA256()


def _sign(key: Any, data: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding

    signature: bytes
    if isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(data)
    elif isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(data, ec.ECDSA(_hash_for(key)))
    else:
        signature = key.sign(data, padding.PSS(mgf=padding.MGF1(_hash_for(key)), salt_length=padding.PSS.MAX_LENGTH),
                             _hash_for(key))
    return signature


def _verify(key: Any, signature: bytes, data: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding

    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(_hash_for(key)))
        else:
            key.verify(signature, data, padding.PSS(mgf=padding.MGF1(_hash_for(key)),
                                                    salt_length=padding.PSS.AUTO), _hash_for(key))
    except InvalidSignature:
        return False
    return True


def predicate(summary: dict[str, Any]) -> dict[str, Any]:
    """What the signature vouches for beyond the bundle's bytes: the certificate's verdict and clauses."""
    return {"verdict": summary["verdict"], "reason": summary.get("verdict_reason"),
            "clauses": {c["id"]: c["outcome"] for c in summary.get("clauses") or []},
            "platform": summary.get("platform") or {}}


def sign(bundle: Path, key_file: Path, summary: dict[str, Any]) -> Path:
    """Write ``<bundle>.intoto.jsonl``: the bundle's statement, signed with ``key_file``; returns its path."""
    key = load_private_key(key_file)
    statement = {"_type": STATEMENT_TYPE,
                 "subject": [{"name": bundle.name, "digest": {"sha256": sha256_of(bundle)}}],
                 "predicateType": PREDICATE_TYPE, "predicate": predicate(summary)}
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    envelope = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
                "signatures": [{"keyid": key_id(key.public_key()),
                                "sig": base64.b64encode(_sign(key, pae(PAYLOAD_TYPE, payload))).decode()}]}
    out = envelope_path(bundle)
    out.write_text(json.dumps(envelope) + "\n")
    return out


def verify(bundle: Path, envelope_file: Path, key_file: Path, summary: dict[str, Any] | None) -> list[str]:
    """What is wrong with ``envelope_file`` as the signed statement of
    ``bundle`` under the public key ``key_file`` ([] when it holds);
    ``summary`` is the certificate the bundle's results make (None: not compared)."""
    key = load_public_key(key_file)
    try:
        envelope = json.loads(envelope_file.read_text())
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = [base64.b64decode(s["sig"], validate=True) for s in envelope["signatures"]]
        payload_type = envelope["payloadType"]
    except FileNotFoundError:
        return [f"no signed statement: {envelope_file} does not exist (certify --sign-key writes it)"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{envelope_file} is not a DSSE envelope ({type(exc).__name__}: {exc})"]
    if payload_type != PAYLOAD_TYPE:
        return [f"{envelope_file}: payloadType {payload_type!r}, expected {PAYLOAD_TYPE!r}"]
    if not any(_verify(key, sig, pae(payload_type, payload)) for sig in signatures):
        return [f"{envelope_file}: no signature verifies with the key {key_file} (key id {key_id(key)[:16]})"]
    statement = json.loads(payload)
    problems = []
    digests = {s.get("name"): (s.get("digest") or {}).get("sha256") for s in statement.get("subject") or []}
    actual = sha256_of(bundle)
    if digests.get(bundle.name) != actual:
        problems.append(f"the signed statement names {digests} but {bundle.name} has sha256 {actual}: the bundle "
                        "is not the one that was signed")
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
        problems.append(f"the signed statement is a {statement.get('_type')} of {statement.get('predicateType')}, "
                        f"not a {PREDICATE_TYPE}")
    if summary is not None and statement.get("predicate") != predicate(summary):
        problems.append(f"the signed certificate ({(statement.get('predicate') or {}).get('verdict')}) is not the "
                        f"one the bundle's results make ({summary['verdict']})")
    return problems

