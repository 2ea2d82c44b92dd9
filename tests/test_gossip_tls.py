"""Gossip peers with mutual TLS: only a node holding its own certificate gets a frame in."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedddl.gossip.peer import main as peer_main
from fedddl.gossip.peer_node import NodeConfig, PeerNode
from fedddl.gossip.tls import PeerTls, node_id_of_certificate
from fedddl.models import create_model
from tests.support.gossip_nodes import (
    issue_certs,
    make_node,
    model_frame,
    raw_send,
    run_to_completion,
    tiny_data,
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return issue_certs(tmp_path_factory.mktemp("certs"), peers=3)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return issue_certs(tmp_path_factory.mktemp("other-ca"), peers=3)


@pytest.fixture()
def secure_receiver(certs: Path) -> Iterator[PeerNode]:
    """Node 0 with mutual TLS, manual mode; it knows nodes 1 and 2 (never dialled)."""
    node = make_node(0, tls=PeerTls.load(certs, 0), clip=0.0)  # never steps: merges unclipped
    node.serve()
    node.set_peers({1: "127.0.0.1:1", 2: "127.0.0.1:1"})
    node.start_training(run_threads=False)
    yield node
    node.stop(grace_s=0)


def test_deploy_certs_issue_one_certificate_per_gossip_node(tmp_path: Path) -> None:
    from fedddl.cli import main

    assert main(["deploy", "certs", str(tmp_path), "--gossip-peers", "2"]) == 0
    gossip = tmp_path / "gossip"
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    assert (gossip / "ca.crt").read_bytes() == (tmp_path / "ca.crt").read_bytes()
    for node in range(2):
        cert = x509.load_pem_x509_certificate((gossip / f"node-{node}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)  # the deployment's CA, the SuperLink's too
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert cn == f"gossip-node-{node}" and san.get_values_for_type(x509.DNSName) == [cn]
        assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        assert stat.S_IMODE((gossip / f"node-{node}.key").stat().st_mode) == 0o600
        assert node_id_of_certificate((gossip / f"node-{node}.pem").read_bytes()) == node
    assert sorted(p.name for p in gossip.iterdir()) == [
        "ca.crt", "node-0.key", "node-0.pem", "node-1.key", "node-1.pem"]
    assert not list(tmp_path.glob("**/ca.key"))  # nobody can issue more from this CA


def test_tls_material_must_be_the_nodes_own(tmp_path: Path, certs: Path) -> None:
    with pytest.raises(ValueError, match="lacks"):
        PeerTls.load(tmp_path, 0)
    for name in ("ca.crt", "node-1.key"):
        shutil.copy(certs / name, tmp_path / name)
    shutil.copy(certs / "node-1.pem", tmp_path / "node-0.pem")
    shutil.copy(certs / "node-1.key", tmp_path / "node-0.key")
    with pytest.raises(ValueError, match="certificate of gossip-node-1, not of gossip-node-0"):
        PeerTls.load(tmp_path, 0)
    with pytest.raises(ValueError, match="TLS material of node 1"):
        make_node(0, tls=PeerTls.load(certs, 1))


def test_only_a_node_with_its_own_certificate_gets_a_frame_in(
    secure_receiver: PeerNode, certs: Path, other_ca: Path
) -> None:
    address = secure_receiver.server.address
    other = {k: v + 1.0 for k, v in create_model("digits", seed=1).state_dict().items()}
    claims_node_1 = model_frame(other, sender=1)
    ca_only = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.crt").read_bytes())
    attempts = {
        "outsider, plaintext": raw_send(address, claims_node_1),
        "outsider, TLS without a certificate": raw_send(address, claims_node_1,
                                                         credentials=ca_only),
        "node 1's certificate from another CA": raw_send(
            address, claims_node_1, tls=PeerTls.load(other_ca, 1)),
        "node 2's valid certificate, claiming node 1": raw_send(
            address, claims_node_1, tls=PeerTls.load(certs, 2)),
    }
    before = secure_receiver.fingerprint()
    assert attempts["outsider, plaintext"][0] == grpc.StatusCode.UNAVAILABLE
    assert attempts["outsider, TLS without a certificate"][0] == grpc.StatusCode.UNAVAILABLE
    assert attempts["node 1's certificate from another CA"][0] == grpc.StatusCode.UNAVAILABLE
    code, details = attempts["node 2's valid certificate, claiming node 1"]
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "claims to be from node 1" in details and "node 2's" in details
    assert secure_receiver.merge_pending() == 0
    assert secure_receiver.fingerprint() == before

    # A client that believes it dials node 1 refuses node 0's server certificate.
    mistaken = raw_send(address, claims_node_1, tls=PeerTls.load(certs, 1), server_node=1)
    assert mistaken[0] == grpc.StatusCode.UNAVAILABLE
    # Node 1 itself gets in: the refusals above could have gone the other way.
    assert raw_send(address, claims_node_1, tls=PeerTls.load(certs, 1))[0] == grpc.StatusCode.OK
    assert secure_receiver.merge_pending() == 1 and secure_receiver.fingerprint() != before
    metrics = secure_receiver.metrics()
    assert metrics["secure"] and metrics["received_from"] == {"1": 1}
    # Handshake failures never reach the frame handler; the impostor is counted by identity.
    assert metrics["rejections"] == {"node 2": {"identity-mismatch": 1}}


def test_insecure_nodes_only_serve_and_dial_loopback() -> None:
    config = NodeConfig(node_id=0)
    with pytest.raises(ValueError, match="loopback"):
        PeerNode(config, create_model("digits", seed=0), tiny_data(0), bind="0.0.0.0:0")
    node = make_node(0)
    try:
        with pytest.raises(ValueError, match="peer 1"):
            node.set_peers({1: "10.0.0.5:7000"})
        node.set_peers({1: "localhost:7000", 2: "127.0.0.2:7000"})
    finally:
        node.stop(grace_s=0)


def test_peer_command_needs_tls_or_an_explicit_insecure_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--node-id", "0", "--num-nodes", "2", "--peers", "1=127.0.0.1:9"]
    assert peer_main(base) == 2
    assert "--tls-dir DIR (mutual TLS) or --insecure" in capsys.readouterr().err
    assert peer_main([*base, "--insecure", "--dataset", "no-such-data"]) == 2
    err = capsys.readouterr().err
    assert "WARNING" in err and "--insecure" in err and "loopback" in err
    with pytest.raises(SystemExit):
        peer_main([*base, "--insecure", "--tls-dir", "x"])


def test_secure_compressed_nodes_learn_together(
    certs: Path, digits_train: tuple[torch.Tensor, torch.Tensor],
    digits_test: tuple[torch.Tensor, torch.Tensor],
) -> None:
    from fedddl.gossip.peer_node import TrainingData

    x, y = digits_train
    x_test, y_test = digits_test
    nodes = [
        make_node(i, tls=PeerTls.load(certs, i), steps=150, min_step_s=0.005,
                  compressor="ternary-base3", eval_every=150,
                  data=TrainingData(x[i::3], y[i::3], x_test, y_test))
        for i in range(3)
    ]
    assert run_to_completion(nodes, timeout_s=120)
    model_bytes = sum(v.numel() * 4 for v in nodes[0].model.state_dict().values())
    for node in nodes:
        m = node.metrics()
        assert m["finished"] and m["received"] > 0 and m["merged"] > 0, m
        assert m["final_accuracy"] > m["initial_accuracy"] + 0.3, m
        # Only the normal answers of a node that is done (or not started) were refusals.
        refusals = {reason for reasons in m["rejections"].values() for reason in reasons}
        assert refusals <= {"finished", "not-ready"} and m["key_frames_sent"] == 0, m
        # Every model frame, headers included, is a small fraction of the fp32 model.
        assert m["model_bytes_sent"] < m["sent"] * model_bytes / 8, m
