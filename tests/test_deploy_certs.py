"""Tests for fedddl.deploy.certs: the material Flower's TLS and SuperNode auth accept."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    load_pem_private_key,
    load_ssh_private_key,
    load_ssh_public_key,
)

from fedddl.deploy.certs import (
    generate_tls_material,
    write_supernode_keys,
    write_tls_material,
)


def _handshake(paths_dir: Path, server_dir: Path, hostname: str) -> str:
    """TLS handshake on loopback: server uses ``server_dir``'s cert, client trusts ``paths_dir``."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server_dir / "server.pem", server_dir / "server.key")
    client_ctx = ssl.create_default_context(cafile=str(paths_dir / "ca.crt"))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError) as err:
            errors.append(err)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                client_ctx.wrap_socket(raw, server_hostname=hostname) as tls:
            return tls.recv(2).decode()
    finally:
        listener.close()
        thread.join(timeout=5)


def test_server_certificate_is_signed_by_ca_and_names_the_hosts(tmp_path: Path) -> None:
    paths = write_tls_material(tmp_path, hosts=["127.0.0.1", "localhost", "superlink.lan"])
    ca = x509.load_pem_x509_certificate(paths.ca_certificate.read_bytes())
    server = x509.load_pem_x509_certificate(paths.server_certificate.read_bytes())
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "superlink.lan"]
    key = load_pem_private_key(paths.server_private_key.read_bytes(), password=None)
    assert key.public_key() == server.public_key()
    assert stat.S_IMODE(paths.server_private_key.stat().st_mode) == 0o600
    assert paths.superlink_args() == [
        "--ssl-ca-certfile", str(paths.ca_certificate),
        "--ssl-certfile", str(paths.server_certificate),
        "--ssl-keyfile", str(paths.server_private_key),
    ]


@pytest.mark.parametrize("hostname", ["127.0.0.1", "localhost"])
def test_real_tls_handshake_verifies_against_the_ca(tmp_path: Path, hostname: str) -> None:
    write_tls_material(tmp_path)
    assert _handshake(tmp_path, tmp_path, hostname) == "ok"


def test_handshake_fails_with_another_ca_or_host(tmp_path: Path) -> None:
    write_tls_material(tmp_path / "a")
    write_tls_material(tmp_path / "b")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path / "b", tmp_path / "a", "127.0.0.1")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(tmp_path / "a", tmp_path / "a", "example.org")


def test_supernode_keys_are_p384_openssh_pairs(tmp_path: Path) -> None:
    pairs = write_supernode_keys(tmp_path, ["node-0", "node-1"])
    assert [p.name for p in pairs] == ["node-0", "node-1"]
    publics = []
    for pair in pairs:
        private = load_ssh_private_key(pair.private_key.read_bytes(), password=None)
        public = load_ssh_public_key(pair.public_key.read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert isinstance(public, ec.EllipticCurvePublicKey)
        assert private.curve.name == "secp384r1"
        assert private.public_key() == public
        assert pair.public_key.read_text().rstrip().endswith(pair.name)
        assert stat.S_IMODE(pair.private_key.stat().st_mode) == 0o600
        publics.append(pair.public_key.read_bytes())
    assert publics[0] != publics[1]


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="distinct"):
        write_supernode_keys(tmp_path, ["a", "a"])
    with pytest.raises(ValueError, match="invalid"):
        write_supernode_keys(tmp_path, ["../escape"])
    with pytest.raises(ValueError, match="at least one"):
        generate_tls_material([])
    with pytest.raises(ValueError, match="positive"):
        generate_tls_material(valid_days=0)


def test_cli_writes_certificates_and_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedddl.cli import main

    assert main(["deploy", "certs", str(tmp_path), "--supernodes", "2", "--host", "10.1.2.3"]) == 0
    out = capsys.readouterr().out
    assert "--enable-supernode-auth" in out and "flwr supernode register" in out
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert sorted(p.name for p in (tmp_path / "supernode-keys").iterdir()) == [
        "supernode-0", "supernode-0.pub", "supernode-1", "supernode-1.pub"]
