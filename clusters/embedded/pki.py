"""Certificates and keys of the embedded platform.

One cluster CA signs everything that authenticates to or is served by the API
server: the API server's serving certificate, the client certificates of the
admin, the controller manager, the scheduler, the operators and the API
server's own client identity toward the nodes' kubelets, the kubelets' serving and
client certificates, and the serving certificates of the controller manager,
the scheduler and Kueue's webhook/metrics servers (so every health check can
verify TLS against one CA rather than switching verification off).

A separate front-proxy CA signs the aggregator's client certificate, as
kubeadm does: the API server trusts request headers only from clients signed
by that CA, so an admin certificate can never impersonate via headers.

Keys are ECDSA P-256: generation is instant on two cores (RSA-2048 is not),
and every component here (Go's crypto/tls, client-go, the API server's
service-account signer, which then issues ES256 tokens) accepts them.

Everything is written once into one directory; a second :func:`ensure_pki` on
the same directory loads what is there, so a restarted control plane keeps
its identities and existing service-account tokens stay valid.
"""
from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The first address of --service-cluster-ip-range (198.19.0.0/16): the API
# server allocates it to the `kubernetes` Service and pods reach it there.
SERVICE_CLUSTER_IP_RANGE = "198.19.0.0/16"
FIRST_SERVICE_IP = "198.19.0.1"

APISERVER_DNS_SANS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
APISERVER_IP_SANS = ("127.0.0.1", FIRST_SERVICE_IP)
LOOPBACK_SANS = (("localhost",), ("127.0.0.1",))

# Long enough for any test run, short enough not to look like a real CA.
VALIDITY = _dt.timedelta(days=365)
# Tolerates clock skew between the moment of issue and a process that checks.
BACKDATE = _dt.timedelta(minutes=5)


@dataclass(frozen=True)
class CertPair:
    """Paths of one issued certificate and its private key (PEM)."""

    cert: Path
    key: Path

    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    def key_pem(self) -> bytes:
        return self.key.read_bytes()


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> None:
    """Write a key readable by its owner only, atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _name(cn: str, orgs: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


class CertificateAuthority:
    """A CA whose certificate and key live in ``<dir>/<stem>.crt|.key``."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, pair: CertPair):
        self.certificate = cert
        self.private_key = key
        self.pair = pair

    @classmethod
    def ensure(cls, directory: Path, stem: str, common_name: str) -> "CertificateAuthority":
        """Load the CA from ``directory`` or create it there."""
        pair = CertPair(directory / f"{stem}.crt", directory / f"{stem}.key")
        if pair.cert.is_file() and pair.key.is_file():
            cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
            key = serialization.load_pem_private_key(pair.key.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{pair.key} is not an ECDSA key; remove {directory} to regenerate")
            return cls(cert, key, pair)
        key = _new_key()
        now = _dt.datetime.now(_dt.timezone.utc)
        subject = _name(common_name)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        _write_private(pair.key, _key_pem(key))
        _write_public(pair.cert, cert.public_bytes(serialization.Encoding.PEM))
        return cls(cert, key, pair)

    def issue(
        self,
        directory: Path,
        stem: str,
        common_name: str,
        *,
        orgs: Sequence[str] = (),
        dns_names: Iterable[str] = (),
        ip_addresses: Iterable[str] = (),
        server: bool = False,
        client: bool = False,
        reuse: bool = True,
    ) -> CertPair:
        """Issue ``<directory>/<stem>.crt|.key`` signed by this CA.

        With ``reuse`` an existing pair signed by this CA is returned as it
        is, so identities survive a restart of the control plane.
        """
        if not (server or client):
            raise ValueError("a certificate must be for server or client use (or both)")
        pair = CertPair(directory / f"{stem}.crt", directory / f"{stem}.key")
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        subject = _name(common_name, orgs)
        if reuse and pair.cert.is_file() and pair.key.is_file() and self._matches(pair.cert, subject, sans):
            return pair
        key = _new_key()
        now = _dt.datetime.now(_dt.timezone.utc)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=False,
                    crl_sign=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.private_key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        elif server:
            raise ValueError(f"serving certificate {stem} needs at least one SAN")
        cert = builder.sign(self.private_key, hashes.SHA256())
        directory.mkdir(parents=True, exist_ok=True)
        _write_private(pair.key, _key_pem(key))
        _write_public(pair.cert, cert.public_bytes(serialization.Encoding.PEM))
        return pair

    def _matches(self, cert_path: Path, subject: x509.Name, sans: list[x509.GeneralName]) -> bool:
        """Whether an existing certificate is ours and says what was asked."""
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            cert.verify_directly_issued_by(self.certificate)
        except (ValueError, TypeError, OSError, InvalidSignature):
            return False
        try:
            have = list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        except x509.ExtensionNotFound:
            have = []
        remaining = cert.not_valid_after_utc - _dt.datetime.now(_dt.timezone.utc)
        return cert.subject == subject and set(have) == set(sans) and remaining > VALIDITY / 2


@dataclass(frozen=True)
class NodeCerts:
    """A node's kubelet's identities: serving (for the API server's calls to it)
    and client (to the API server, as ``system:node:<name>``)."""

    name: str
    serving: CertPair
    client: CertPair


class ClusterPKI:
    """All certificates of one embedded control plane, under ``<run>/pki``.

    Attributes are :class:`CertPair` s; ``ca_file`` is what every client and
    every server here trusts.
    """

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self.ca = CertificateAuthority.ensure(directory, "ca", "rayproof-embedded-ca")
        self.front_proxy_ca = CertificateAuthority.ensure(directory, "front-proxy-ca", "rayproof-front-proxy-ca")
        ca = self.ca
        d = directory
        self.apiserver = ca.issue(
            d, "apiserver", "kube-apiserver",
            dns_names=APISERVER_DNS_SANS, ip_addresses=APISERVER_IP_SANS, server=True,
        )
        # The API server's identity when it calls the nodes' kubelets (logs,
        # exec, port-forward, proxy). system:masters so a kubelet's webhook
        # authorizer may simply allow it.
        self.apiserver_kubelet_client = ca.issue(
            d, "apiserver-kubelet-client", "kube-apiserver-kubelet-client",
            orgs=("system:masters",), client=True,
        )
        self.front_proxy_client = self.front_proxy_ca.issue(
            d, "front-proxy-client", "front-proxy-client", client=True,
        )
        self.admin = ca.issue(d, "admin", "rayproof-admin", orgs=("system:masters",), client=True)
        # Well-known identities that the bootstrap RBAC policy already binds.
        self.controller_manager = ca.issue(
            d, "controller-manager", "system:kube-controller-manager", client=True,
        )
        self.scheduler = ca.issue(d, "scheduler", "system:kube-scheduler", client=True)
        # Serving certificates of the components' own secure ports, so their
        # /healthz can be checked with verification on.
        self.controller_manager_serving = ca.issue(
            d, "controller-manager-serving", "kube-controller-manager",
            dns_names=LOOPBACK_SANS[0], ip_addresses=LOOPBACK_SANS[1], server=True,
        )
        self.scheduler_serving = ca.issue(
            d, "scheduler-serving", "kube-scheduler",
            dns_names=LOOPBACK_SANS[0], ip_addresses=LOOPBACK_SANS[1], server=True,
        )
        # The operators are part of the platform under test, not workloads:
        # they get cluster-admin (system:masters) rather than upstream's
        # ClusterRoles, which are not among the copied manifests. Distinct
        # CNs keep them apart in audit and in `kubectl get --show-managed-fields`.
        self.kuberay_operator = ca.issue(
            d, "kuberay-operator", "kuberay-operator", orgs=("system:masters",), client=True,
        )
        self.kueue_manager = ca.issue(
            d, "kueue-manager", "kueue-controller-manager", orgs=("system:masters",), client=True,
        )
        self.sa_private, self.sa_public = self._service_account_keys()

    @property
    def ca_file(self) -> Path:
        return self.ca.pair.cert

    def ca_pem(self) -> bytes:
        return self.ca.pair.cert_pem()

    def _service_account_keys(self) -> tuple[Path, Path]:
        """The key pair the API server signs service-account tokens with."""
        priv, pub = self.dir / "sa.key", self.dir / "sa.pub"
        if not (priv.is_file() and pub.is_file()):
            key = _new_key()
            _write_private(priv, _key_pem(key))
            _write_public(
                pub,
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                ),
            )
        return priv, pub

    def webhook_serving(self, stem: str, common_name: str, directory: Path | None = None) -> CertPair:
        """A serving certificate with SANs 127.0.0.1 and localhost, for a
        webhook or metrics server the API server (or a test) dials on loopback."""
        return self.ca.issue(
            directory or self.dir, stem, common_name,
            dns_names=LOOPBACK_SANS[0], ip_addresses=LOOPBACK_SANS[1], server=True,
        )

    def issue_node(self, name: str, ip_addresses: Sequence[str] = (), directory: Path | None = None) -> NodeCerts:
        """Serving and client certificates for the kubelet of node ``name``.

        The client certificate is ``CN=system:node:<name>, O=system:nodes``,
        what the Node authorizer and NodeRestriction admission expect. The
        serving certificate carries the node name, ``localhost``,
        ``127.0.0.1`` and ``ip_addresses`` (the node's InternalIP), because the
        API server verifies it against the CA when it calls the kubelet
        (``--kubelet-certificate-authority``).
        """
        if not name or name != name.lower() or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789-." for c in name):
            raise ValueError(f"node name {name!r} must be a lowercase DNS subdomain")
        d = directory or (self.dir / "nodes" / name)
        ips = list(dict.fromkeys(["127.0.0.1", *ip_addresses]))
        serving = self.ca.issue(
            d, "kubelet-serving", f"system:node:{name}", orgs=("system:nodes",),
            dns_names=(name, "localhost"), ip_addresses=ips, server=True,
        )
        client = self.ca.issue(
            d, "kubelet-client", f"system:node:{name}", orgs=("system:nodes",), client=True,
        )
        return NodeCerts(name=name, serving=serving, client=client)


def ensure_pki(directory: Path) -> ClusterPKI:
    """Create (or load) the control plane's PKI in ``directory``."""
    return ClusterPKI(directory)
