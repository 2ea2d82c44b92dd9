"""The run's device: names, placement, and code that never mixes devices.

CI has no GPU. The device-generic code runs here on the CPU and on PyTorch's ``meta``
device (tensors without data: any operation mixing a meta tensor with a CPU tensor fails,
so a CPU tensor created where the replica's device belongs is caught). The ``gpu`` test
runs one TernGrad round on CUDA when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from fedddl.app_config import AppConfig
from fedddl.compression import ResidualMemory
from fedddl.devices import check_device_name, resolve_device
from fedddl.models import create_model
from fedddl.replica import Replica
from fedddl.running_stats import apply_statistics


def test_device_names() -> None:
    for name in ("cpu", "cuda", "cuda:1", "auto"):
        assert check_device_name(name) == name
    for bad in ("gpu", "cuda:", "CPU", "cuda:x"):
        with pytest.raises(ValueError, match="device must be"):
            check_device_name(bad)
    with pytest.raises(ValueError, match="device must be"):
        AppConfig(device="tpu")
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_model_factory_places_models() -> None:
    model = AppConfig().model_factory(device="meta")()
    assert {p.device.type for p in model.parameters()} == {"meta"}


def _meta_replica() -> Replica:
    return Replica(create_model("digits", seed=0, arch="resnet8").to("meta"), 0.1, 0.9)


@pytest.mark.filterwarnings("ignore:.*meta parameter:UserWarning")
def test_replica_updates_on_another_device_take_host_tensors() -> None:
    """Decoded updates, snapshots and statistics arrive on the host; the replica moves them."""
    replica = _meta_replica()
    update = {k: torch.zeros(p.shape) for k, p in replica.model.named_parameters()}
    stats = {}
    for name, module in replica.model.named_modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            c = module.num_features
            stats |= {f"{name}.mean": torch.zeros(c), f"{name}.var": torch.ones(c),
                      f"{name}.count": torch.tensor([10.0])}
    replica.apply_update(update, 1, stats)  # a CPU tensor mixed in would raise here
    host = create_model("digits", seed=0, arch="resnet8")
    snapshot = Replica(host, 0.1, 0.9)
    snapshot.apply_update({k: torch.ones(p.shape) for k, p in host.named_parameters()}, 1,
                          {k: v.clone() for k, v in stats.items()})
    replica.load_snapshot(snapshot.snapshot(), 1)
    momentum = {buf.device.type for buf in (s["momentum_buffer"]
                                             for s in replica.optimizer.state.values())}
    assert momentum == {"meta"}
    apply_statistics(replica.model, stats)
    assert {b.device.type for b in replica.model.buffers()} == {"meta"}


def test_residual_memory_keeps_the_tensor_device() -> None:
    memory = ResidualMemory()
    tensor = torch.zeros(3, device="meta")
    memory.update("w", tensor, torch.ones(3))  # decompressed on the host
    assert memory.residuals["w"].device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_one_terngrad_round_on_cuda() -> None:
    from clients.client_app import make_client_app
    from fedddl.flower.inline_grid import InlineGrid
    from strategies.server_app import run_server

    cfg = AppConfig(num_server_rounds=2, device="cuda", arch="resnet8", min_available_nodes=2)
    result = run_server(InlineGrid(make_client_app(cfg), 2), cfg, progress=lambda _: None)
    assert all(r["replicas_equal"] for r in result["rounds"])
    assert result["final_version"] == 2


@pytest.mark.filterwarnings("ignore:.*meta:UserWarning")
def test_broadcast_decodes_into_buffers_on_the_replica_device() -> None:
    """An ``E`` broadcast (alone or bundled with statistics) decodes into device buffers;
    on the CPU the values equal a host decode."""
    from fedddl.compression import get_compressor
    from fedddl.compression.codecs.downlink import (
        decode_broadcast_parts,
        encode_bundle,
        encode_reencoded,
    )

    grads = {"a": torch.randn(7, 5), "b": torch.randn(3)}
    payload = encode_reencoded(grads, get_compressor("ternary-base3", seed=2), None)
    bundled = encode_bundle(payload, statistics={"bn.mean": torch.zeros(2)})
    for data in (payload, bundled):
        host, _ = decode_broadcast_parts(data)
        buffers = {k: torch.empty(v.shape) for k, v in grads.items()}
        into, stats = decode_broadcast_parts(data, out=buffers)
        assert all(into[k] is buffers[k] and torch.equal(into[k], host[k]) for k in grads)
        assert (data is bundled) == bool(stats)
        meta = {k: torch.empty(v.shape, device="meta") for k, v in grads.items()}
        on_meta, _ = decode_broadcast_parts(data, out=meta)
        assert {t.device.type for t in on_meta.values()} == {"meta"}
