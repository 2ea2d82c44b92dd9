"""TLS certificates and SuperNode authentication keys for a Flower deployment.

Flower 1.42 needs three kinds of key material for a secured deployment:

* a CA certificate, a server certificate signed by it and the server's private
  key: the SuperLink serves its (single, HTTP) port with them
  (``--ssl-ca-certfile``, ``--ssl-certfile``, ``--ssl-keyfile``) and every
  SuperNode verifies the SuperLink with the CA (``--root-certificates``);
* one EC key pair per SuperNode (a NIST curve, OpenSSH encoding): the SuperNode
  signs its requests with the private key (``--auth-supernode-private-key``)
  and the operator registers the public key with
  ``flwr supernode register KEY.pub`` on a SuperLink started with
  ``--enable-supernode-auth``.

Gossip peers (``python -m fedddl.gossip.peer --tls-dir DIR``) talk to each
other with mutual TLS: :func:`write_tls_material` with ``gossip_peers=N`` also
issues, from the same CA, one certificate per gossip node id, whose subject
common name and only DNS name are ``gossip-node-<id>``
(:func:`fedddl.gossip.tls.peer_name`). It is both a server and a client
certificate: a peer serves with it, dials with it, and its peers read its node
id from it. The CA's private key is not written anywhere, so nobody can issue
further peer certificates from this CA later.

Everything is generated with :mod:`cryptography`; private keys are written
with mode ``0600``.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DEFAULT_HOSTS",
    "GOSSIP_DIR",
    "SuperNodeKeyPaths",
    "TlsPaths",
    "generate_supernode_key",
    "generate_tls_material",
    "write_supernode_keys",
    "write_tls_material",
]

#: Names the test and local deployments reach the SuperLink by.
DEFAULT_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost")

# P-384 is what Flower's docs use for SuperNode keys; any NIST curve is accepted.
_SUPERNODE_CURVE = ec.SECP384R1()
_TLS_CURVE = ec.SECP256R1()
#: Subfolder of ``write_tls_material``'s output with the gossip peers' material.
GOSSIP_DIR = "gossip"
# Kept in step with fedddl.gossip.tls.peer_name (the core must not import the gossip
# peer's gRPC stack just to name a certificate).
_GOSSIP_NAME_PREFIX = "gossip-node-"


@dataclass(frozen=True)
class TlsPaths:
    """Files of a TLS bundle for the SuperLink (and the CA the SuperNodes trust)."""

    ca_certificate: Path
    server_certificate: Path
    server_private_key: Path
    #: Folder with ``ca.crt`` and ``node-<id>.pem``/``.key`` per gossip peer, if issued.
    gossip_dir: Path | None = None

    def superlink_args(self) -> list[str]:
        """Return the ``flower-superlink`` arguments that enable TLS with this bundle."""
        return [
            "--ssl-ca-certfile",
            str(self.ca_certificate),
            "--ssl-certfile",
            str(self.server_certificate),
            "--ssl-keyfile",
            str(self.server_private_key),
        ]


@dataclass(frozen=True)
class SuperNodeKeyPaths:
    """One SuperNode's authentication key pair on disk (OpenSSH format)."""

    name: str
    private_key: Path
    public_key: Path


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _subject_alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        if _is_ip(host):
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        else:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


@dataclass(frozen=True)
class _Authority:
    """A CA certificate with its key, kept in memory only."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    not_before: _dt.datetime
    not_after: _dt.datetime


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _new_authority(valid_days: int, organisation: str) -> _Authority:
    if valid_days <= 0:
        raise ValueError(f"valid_days must be positive, got {valid_days}")
    now = _dt.datetime.now(_dt.timezone.utc)
    # Back-date a little so that small clock skew between machines does not
    # make a fresh certificate "not yet valid".
    not_before = now - _dt.timedelta(minutes=5)
    not_after = now + _dt.timedelta(days=valid_days)
    ca_key = ec.generate_private_key(_TLS_CURVE)
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{organisation} deployment CA"),
        ]
    )
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _Authority(ca_cert, ca_key, not_before, not_after)


def _issue(
    ca: _Authority,
    common_name: str,
    names: x509.SubjectAlternativeName,
    usages: list[x509.ObjectIdentifier],
    organisation: str,
) -> tuple[bytes, bytes]:
    """A leaf certificate signed by ``ca`` and its private key, both PEM."""
    key = ec.generate_private_key(_TLS_CURVE)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca.not_before)
        .not_valid_after(ca.not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(names, critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )
    return _pem(certificate), _key_pem(key)


def _server_certificate(
    ca: _Authority, hosts: Sequence[str], organisation: str
) -> tuple[bytes, bytes]:
    if not hosts:
        raise ValueError("hosts must name at least one host or IP address")
    return _issue(
        ca, hosts[0], _subject_alt_names(hosts), [ExtendedKeyUsageOID.SERVER_AUTH], organisation
    )


def _gossip_peer_certificate(
    ca: _Authority, node_id: int, organisation: str
) -> tuple[bytes, bytes]:
    if node_id < 0:
        raise ValueError(f"gossip node ids are >= 0, got {node_id}")
    name = f"{_GOSSIP_NAME_PREFIX}{node_id}"
    return _issue(
        ca,
        name,
        x509.SubjectAlternativeName([x509.DNSName(name)]),
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        organisation,
    )


def generate_tls_material(
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    valid_days: int = 365,
    organisation: str = "fedddl",
) -> tuple[bytes, bytes, bytes]:
    """Generate a self-signed CA and a server certificate signed by it.

    Returns ``(ca_certificate_pem, server_certificate_pem, server_private_key_pem)``. Each of
    ``hosts`` (names and IP addresses the SuperLink is reached by) becomes a subjectAltName
    of the server certificate; both certificates are valid ``valid_days`` from now and name
    ``organisation``. Raises ``ValueError`` if ``hosts`` is empty or ``valid_days`` is not
    positive.
    """
    if not hosts:
        raise ValueError("hosts must name at least one host or IP address")
    ca = _new_authority(valid_days, organisation)
    cert_pem, key_pem = _server_certificate(ca, hosts, organisation)
    return _pem(ca.certificate), cert_pem, key_pem


def generate_supernode_key(comment: str = "") -> tuple[bytes, bytes]:
    """Generate one SuperNode authentication key pair (EC P-384, OpenSSH format).

    Parameters
    ----------
    comment : str
        Appended to the public key line (e.g. the node's name); ignored by Flower.

    Returns
    -------
    tuple of bytes
        ``(private_key_openssh, public_key_openssh)``; the format
        ``flower-supernode --auth-supernode-private-key`` and
        ``flwr supernode register`` read.
    """
    key = ec.generate_private_key(_SUPERNODE_CURVE)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    if comment:
        public += b" " + comment.encode("utf-8")
    return private, public + b"\n"


def _write_private(path: Path, data: bytes) -> None:
    # Create with 0600 from the start so the key is never world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def write_tls_material(
    out_dir: str | Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    valid_days: int = 365,
    gossip_peers: int = 0,
) -> TlsPaths:
    """Generate a CA + server certificate (+ gossip peer certificates) into ``out_dir``.

    Files: ``ca.crt``, ``server.pem`` and ``server.key`` (mode 0600); with
    ``gossip_peers = N`` also ``gossip/ca.crt`` and ``gossip/node-<id>.pem`` /
    ``gossip/node-<id>.key`` (mode 0600) for ids ``0 .. N-1``, signed by the same CA.
    ``gossip/`` is what a peer's ``--tls-dir`` names (each machine needs ``ca.crt``
    and its own node's pair only).

    Parameters
    ----------
    out_dir : str or Path
        Directory to write into (created if missing).
    hosts : sequence of str
        Host names / IP addresses of the SuperLink (subjectAltNames).
    valid_days : int
        Validity of the certificates.
    gossip_peers : int
        Number of gossip peer certificates to issue.

    Returns
    -------
    TlsPaths
        Where the files are.

    Raises
    ------
    ValueError
        If ``hosts`` is empty, ``valid_days`` is not positive or ``gossip_peers < 0``.
    """
    if gossip_peers < 0:
        raise ValueError(f"gossip_peers must be >= 0, got {gossip_peers}")
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    ca = _new_authority(valid_days, "fedddl")
    cert_pem, key_pem = _server_certificate(ca, hosts, "fedddl")
    paths = TlsPaths(
        ca_certificate=directory / "ca.crt",
        server_certificate=directory / "server.pem",
        server_private_key=directory / "server.key",
        gossip_dir=directory / GOSSIP_DIR if gossip_peers else None,
    )
    paths.ca_certificate.write_bytes(_pem(ca.certificate))
    paths.server_certificate.write_bytes(cert_pem)
    _write_private(paths.server_private_key, key_pem)
    if paths.gossip_dir is not None:
        paths.gossip_dir.mkdir(exist_ok=True)
        (paths.gossip_dir / "ca.crt").write_bytes(_pem(ca.certificate))
        for node_id in range(gossip_peers):
            peer_cert, peer_key = _gossip_peer_certificate(ca, node_id, "fedddl")
            (paths.gossip_dir / f"node-{node_id}.pem").write_bytes(peer_cert)
            _write_private(paths.gossip_dir / f"node-{node_id}.key", peer_key)
    return paths


def write_supernode_keys(out_dir: str | Path, names: Sequence[str]) -> list[SuperNodeKeyPaths]:
    """Generate one authentication key pair per SuperNode name into ``out_dir``.

    Files: ``NAME`` (private, mode 0600) and ``NAME.pub`` for each name.

    Parameters
    ----------
    out_dir : str or Path
        Directory to write into (created if missing).
    names : sequence of str
        File-name-safe, distinct names, e.g. ``["supernode-0", "supernode-1"]``.

    Returns
    -------
    list of SuperNodeKeyPaths
        One entry per name, in order.

    Raises
    ------
    ValueError
        If a name is empty, repeated or contains a path separator.
    """
    if len(set(names)) != len(names):
        raise ValueError(f"SuperNode names must be distinct, got {list(names)}")
    for name in names:
        if not name or "/" in name or "\\" in name or name in {".", ".."}:
            raise ValueError(f"invalid SuperNode key name {name!r}")
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    result = []
    for name in names:
        private, public = generate_supernode_key(comment=name)
        entry = SuperNodeKeyPaths(
            name=name, private_key=directory / name, public_key=directory / f"{name}.pub"
        )
        _write_private(entry.private_key, private)
        entry.public_key.write_bytes(public)
        result.append(entry)
    return result
