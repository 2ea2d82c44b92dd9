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


@dataclass(frozen=True)
class TlsPaths:
    """Files of a TLS bundle for the SuperLink (and the CA the SuperNodes trust)."""

    ca_certificate: Path
    server_certificate: Path
    server_private_key: Path

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


def generate_tls_material(
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    valid_days: int = 365,
    organisation: str = "fedddl",
) -> tuple[bytes, bytes, bytes]:
    """Generate a self-signed CA and a server certificate signed by it.

    Parameters
    ----------
    hosts : sequence of str
        Host names and IP addresses the SuperLink is reached by; each becomes a
        subjectAltName of the server certificate (clients check it).
    valid_days : int
        Validity of both certificates, from now.
    organisation : str
        Organisation name written into the certificates' subjects.

    Returns
    -------
    tuple of bytes
        ``(ca_certificate_pem, server_certificate_pem, server_private_key_pem)``.

    Raises
    ------
    ValueError
        If ``hosts`` is empty or ``valid_days`` is not positive.
    """
    if not hosts:
        raise ValueError("hosts must name at least one host or IP address")
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

    server_key = ec.generate_private_key(_TLS_CURVE)
    server_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
            x509.NameAttribute(NameOID.COMMON_NAME, hosts[0]),
        ]
    )
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(server_name)
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_subject_alt_names(hosts), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    return (
        ca_cert.public_bytes(serialization.Encoding.PEM),
        server_cert.public_bytes(serialization.Encoding.PEM),
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


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
) -> TlsPaths:
    """Generate a CA + server certificate and write them to ``out_dir``.

    Files: ``ca.crt``, ``server.pem`` and ``server.key`` (mode 0600).

    Parameters
    ----------
    out_dir : str or Path
        Directory to write into (created if missing).
    hosts : sequence of str
        Host names / IP addresses of the SuperLink (subjectAltNames).
    valid_days : int
        Validity of the certificates.

    Returns
    -------
    TlsPaths
        Where the files are.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    ca_pem, cert_pem, key_pem = generate_tls_material(hosts, valid_days=valid_days)
    paths = TlsPaths(
        ca_certificate=directory / "ca.crt",
        server_certificate=directory / "server.pem",
        server_private_key=directory / "server.key",
    )
    paths.ca_certificate.write_bytes(ca_pem)
    paths.server_certificate.write_bytes(cert_pem)
    _write_private(paths.server_private_key, key_pem)
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
