"""Mutual TLS between gossip peers: each peer proves its node id with a certificate.

A peer's TLS folder (``--tls-dir``, written by ``fedddl deploy certs
--gossip-peers N`` into ``OUT_DIR/gossip``) holds::

    ca.crt            the CA every peer trusts (the deployment's CA)
    node-<id>.pem     this node's certificate: CN and only DNS name "gossip-node-<id>"
    node-<id>.key     its private key

* **Serving**, a peer asks every caller for a certificate signed by the CA
  (``require_client_auth``): a plaintext connection, a caller without a
  certificate and a certificate from another CA all fail the handshake, before
  any frame is read. The caller's node id is read from its verified certificate
  (:func:`caller_identity`), and the frame handler refuses a frame whose sender
  field names another node.
* **Dialling** node ``j``, a peer presents its own certificate and checks that
  the server's certificate is valid for ``gossip-node-<j>`` (gRPC's target-name
  override), whatever address it dialled: it talks to node ``j`` or to nobody.

Without TLS (``--insecure``) nothing is authenticated, so insecure peers only
serve and dial loopback addresses (:func:`require_loopback`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

__all__ = [
    "PEER_NAME_PREFIX",
    "PeerTls",
    "caller_identity",
    "is_loopback",
    "node_id_of_certificate",
    "peer_name",
    "require_loopback",
]

PEER_NAME_PREFIX = "gossip-node-"


def peer_name(node_id: int) -> str:
    """The name in node ``node_id``'s certificate (CN and DNS name)."""
    if node_id < 0:
        raise ValueError(f"gossip node ids are >= 0, got {node_id}")
    return f"{PEER_NAME_PREFIX}{node_id}"


def node_id_of_certificate(pem: bytes) -> int | None:
    """The node id named by a peer certificate (its CN), or ``None`` if it names none."""
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        return None
    value = names[0].value
    text = value.decode() if isinstance(value, bytes) else value
    suffix = text[len(PEER_NAME_PREFIX) :] if text.startswith(PEER_NAME_PREFIX) else ""
    if not suffix.isdigit() or str(int(suffix)) != suffix:
        return None
    return int(suffix)


def caller_identity(context: grpc.ServicerContext) -> int | None:
    """Node id of the caller's TLS client certificate; ``None`` on an insecure server.

    On a mutual-TLS server every call has passed the handshake, so the
    certificate is signed by the CA; its CN gives the node id.
    """
    auth = context.auth_context()
    certs = auth.get("x509_pem_cert") or []
    if not certs:
        return None
    return node_id_of_certificate(certs[0])


@dataclass(frozen=True)
class PeerTls:
    """One node's TLS material (see the module docstring)."""

    node_id: int
    ca_certificate: bytes
    certificate: bytes
    private_key: bytes

    @classmethod
    def load(cls, tls_dir: str | Path, node_id: int) -> PeerTls:
        """Read ``ca.crt`` and ``node-<node_id>.pem``/``.key`` from ``tls_dir``.

        Raises
        ------
        ValueError
            If a file is missing or the certificate is not node ``node_id``'s.
        """
        folder = Path(tls_dir)
        files = {
            "ca": folder / "ca.crt",
            "cert": folder / f"node-{node_id}.pem",
            "key": folder / f"node-{node_id}.key",
        }
        missing = [str(path) for path in files.values() if not path.is_file()]
        if missing:
            raise ValueError(
                f"TLS folder {folder} lacks {', '.join(missing)} "
                f"(create it with: fedddl deploy certs OUT_DIR --gossip-peers N)"
            )
        certificate = files["cert"].read_bytes()
        named = node_id_of_certificate(certificate)
        if named != node_id:
            owner = "no gossip node" if named is None else peer_name(named)
            raise ValueError(
                f"{files['cert']} is the certificate of {owner}, not of {peer_name(node_id)}"
            )
        return cls(node_id, files["ca"].read_bytes(), certificate, files["key"].read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with this node's certificate; callers must present one from the CA."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate)],
            root_certificates=self.ca_certificate,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Dial with this node's certificate, trusting only the CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_certificate,
            private_key=self.private_key,
            certificate_chain=self.certificate,
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (name or address, brackets allowed) is a loopback address."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_loopback(address: str, what: str) -> None:
    """Raise ``ValueError`` unless ``address`` (``host:port``) is on loopback.

    Used for insecure peers: without TLS nothing is authenticated.
    """
    host = address.rsplit(":", 1)[0]
    if not is_loopback(host):
        raise ValueError(
            f"{what} {address!r} is not a loopback address: insecure gossip (no TLS) "
            f"is for loopback only; give the peers a --tls-dir"
        )
