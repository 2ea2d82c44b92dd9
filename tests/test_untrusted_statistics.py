"""Untrusted clients, the parts that came with BatchNorm statistics, fp32 exemptions and
entropy-coded messages: hostile BatchNorm statistics are refused or clipped to the round's
majority, a dense (fp32-exempt) tensor is bounded by its measured peak, and the header of an
entropy-coded message is read like a plain one."""

from __future__ import annotations

import math
import re
import struct
import zlib

import pytest
import torch
from torch import nn

from fedddl.compression import (
    IdentityCompressor,
    PayloadError,
    TernaryCompressor,
    TernaryEntropyCompressor,
    encode_update,
    read_header,
)
from fedddl.defenses import Defenses
from fedddl.running_stats import StatisticsError
from fedddl.sync import ReplicaServer
from fedddl.sync.messages import ClientReply, fingerprint_prefix
from fedddl.sync.statistics_bound import bound_statistics, check_statistics_range

NODES = (1, 2, 3, 4, 5)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def _stats(mean: float = 0.5, var: float = 2.0, count: float = 32.0) -> dict[str, torch.Tensor]:
    return {
        "1.mean": torch.full((3,), mean),
        "1.var": torch.full((3,), var),
        "1.count": torch.tensor([count]),
    }


def _reply(server: ReplicaServer, node: int, stats: dict[str, torch.Tensor]) -> ClientReply:
    model = server.shadow.model
    torch.manual_seed(node)
    grads = {n: 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    version = server.shadow.version
    fingerprint = fingerprint_prefix(server.fingerprints[version]).hex()
    payload = encode_update(grads, IdentityCompressor())
    statistics = encode_update(stats, IdentityCompressor())
    return ClientReply(node, version, fingerprint, payload, 32, 1.0, None, statistics)


def _round(server: ReplicaServer, bad: dict[str, torch.Tensor]) -> None:
    server.plan_round(server.shadow.version + 1, NODES)
    replies = [_reply(server, n, bad if n == 5 else _stats(0.5 + 0.01 * n)) for n in NODES]
    server.aggregate(server.shadow.version + 1, replies)


def test_statistics_limits_name_the_entry() -> None:
    check_statistics_range(_stats())
    for key, stats in (
        ("1.mean", _stats(mean=-2e15)),
        ("1.var", _stats(var=3e30)),
        ("1.count", _stats(count=1e16)),
    ):
        with pytest.raises(StatisticsError, match=key.replace(".", r"\.")):
            check_statistics_range(stats)


def test_bound_statistics_clips_only_the_outlier() -> None:
    per_node = {n: _stats(0.5 + 0.01 * n) for n in NODES}
    per_node[5] = _stats(mean=-1e6, var=1e12, count=1e9)
    honest = {n: {k: v.clone() for k, v in per_node[n].items()} for n in NODES if n != 5}
    reasons = bound_statistics(per_node, factor=8.0)
    assert set(reasons) == {5} and "1.mean" in reasons[5]
    for n, stats in honest.items():
        assert all(torch.equal(stats[k], per_node[n][k]) for k in stats)
    assert float(per_node[5]["1.mean"].abs().max()) <= 8 * 0.53 + 1e-6
    assert float(per_node[5]["1.var"].max()) <= 64 * 2.0 + 1e-4
    assert float(per_node[5]["1.count"]) <= 8 * 32
    assert bound_statistics(per_node, factor=0.0) == {}


def test_hostile_statistics_are_clipped_or_dropped_and_the_buffers_stay_sane() -> None:
    server = ReplicaServer(_bn_net, compressor="identity", fp32_logits=False)
    bn = server.shadow.model.get_submodule("1")
    _round(server, _stats(mean=1e12, var=1e24))  # finite, under the limits: clipped
    report = server.reports[-1]
    assert 5 in report.accepted and "statistics" in report.clipped[5], report.clipped
    assert report.version == 1 and not report.skipped
    assert float(bn.running_mean.abs().max()) < 1.0  # not moved by 1e12 / 5
    assert float(bn.running_var.max()) < 100.0
    _round(server, _stats(mean=math.nextafter(1e15, math.inf) * 10))  # beyond the limit
    report = server.reports[-1]
    assert 5 in report.dropped and "statistics rejected" in report.dropped[5]
    assert report.version == 2 and sorted(report.accepted) == [1, 2, 3, 4]
    assert bool(torch.isfinite(bn.running_var).all())


def test_a_dense_tensor_is_bounded_by_its_peak_and_non_finite_dense_values_are_refused() -> None:
    # the scale bound alone (the norm clip, on by default, also clips honest replies)
    server = ReplicaServer(
        _bn_net, compressor="ternary", fp32_logits=True, defenses=Defenses(norm_clip=0.0)
    )
    server.plan_round(1, NODES)
    replies = []
    for n in NODES:
        reply = _reply(server, n, _stats())
        model = server.shadow.model
        torch.manual_seed(n)
        grads = {k: 0.01 * torch.randn_like(p) for k, p in model.named_parameters()}
        if n == 5:
            grads["2.weight"] = grads["2.weight"] * 1e6  # the fp32 logits, 1e6 x
        compressor = TernaryCompressor(seed=0, scale_bucket=server.scale_bucket)
        payload = encode_update(grads, compressor, dense=("2.weight", "2.bias"))
        replies.append(ClientReply(n, 0, reply.fingerprint, payload, 32, 1.0, None,
                                   reply.statistics))  # fmt: skip
    report = server.aggregate(1, replies)
    assert "'2.weight'" in report.clipped[5] and "exceeds the bound" in report.clipped[5]
    # Random honest tensors of a few values may pass the 3x median cap, never the bound.
    others = [why for node, why in report.clipped.items() if node != 5]
    assert all("exceeds the cap" in why for why in others), report.clipped
    entries = {e.name: e for e in read_header(replies[0].payload or b"", dense_peaks=True)}
    assert entries["2.weight"].codec is None and entries["2.weight"].peak is not None
    assert entries["0.weight"].peak == entries["0.weight"].scale
    plain = encode_update({"w": torch.tensor([1.0, 2.0])}, IdentityCompressor())
    body = plain[:-4].replace(struct.pack("<f", 2.0), struct.pack("<f", math.inf))
    poisoned = body + struct.pack("<I", zlib.crc32(body))  # well-formed, CRC-correct
    assert read_header(poisoned)[0].peak is None  # not asked: the values are not read
    with pytest.raises(PayloadError, match="non-finite"):
        read_header(poisoned, dense_peaks=True)


def test_an_entropy_coded_header_is_read_and_bounded_like_a_plain_one() -> None:
    grads = {f"t{i}": torch.zeros(4096) for i in range(3)}  # all zero: zstd shrinks it
    grads["t0"][:7] = 1.0
    payload = encode_update(grads, TernaryEntropyCompressor(seed=0))
    assert payload[:4] == b"FDTE"
    entries = read_header(payload, max_tensors=3)
    assert [e.name for e in entries] == ["t0", "t1", "t2"] and entries[0].codec == "base3"
    with pytest.raises(PayloadError, match="at most 2 expected"):
        read_header(payload, max_tensors=2)



@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean", "sign-vote"])
def test_robust_aggregators_pool_batchnorm_statistics(aggregator: str) -> None:
    from fedddl.defenses import Defenses

    server = ReplicaServer(
        _bn_net, compressor="identity", fp32_logits=False, defenses=Defenses(aggregator=aggregator)
    )
    _round(server, _stats(mean=0.55))
    report = server.reports[-1]
    assert report.version == 1 and not report.skipped, report.skip_reason
    bn = server.shadow.model.get_submodule("1")
    assert int(bn.num_batches_tracked) == 1
    assert not torch.equal(bn.running_mean, torch.zeros(3))


@pytest.mark.parametrize(("attack", "fate"), [("scale:1e6", "clipped"), ("scale:1e30", "dropped")])
def test_the_scale_attack_on_batchnorm_statistics(attack: str, fate: str) -> None:
    from fedddl.attacks import parse_attack
    from fedddl.attacks.tamper import tamper_reply

    server = ReplicaServer(_bn_net, compressor="identity", fp32_logits=False)
    server.plan_round(1, NODES)
    replies = [_reply(server, n, _stats(0.5 + 0.01 * n)) for n in NODES]
    found = parse_attack(attack)
    assert found is not None
    replies[-1] = tamper_reply(replies[-1], found)
    report = server.aggregate(1, replies)
    assert report.version == 1
    assert 5 in (report.clipped if fate == "clipped" else report.dropped)
    bn = server.shadow.model.get_submodule("1")
    assert float(bn.running_mean.abs().max()) < 1.0


def test_peaks_in_one_pass_equal_the_entry_by_entry_peaks() -> None:
    from fedddl.sync.statistics_bound import _peaks

    gen = torch.Generator().manual_seed(0)
    keys = ["a.mean", "a.var", "a.count", "b.mean", "b.var", "b.count"]
    sizes = [3, 3, 1, 5, 5, 1]
    per_node = {
        n: {k: torch.randn(s, generator=gen) * 10**n for k, s in zip(keys, sizes, strict=True)}
        for n in NODES
    }
    per_node[3]["b.var"] = per_node[3]["b.var"].to(torch.bfloat16)  # numpy has no bfloat16
    table = _peaks(per_node, list(NODES), keys)
    for i, n in enumerate(NODES):
        assert table[i] == [float(per_node[n][k].abs().max()) for k in keys]


def test_check_statistics_names_the_bad_layer_after_the_fused_check() -> None:
    from fedddl.running_stats import check_statistics

    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    good = {f"{layer}.{key[2:]}": v for layer in ("0", "1") for key, v in _stats().items()}
    check_statistics(model, good)
    for part, bad, why in (("mean", math.nan, "finite"), ("var", -1.0, ">= 0"),
                           ("count", 0.5, ">= 1"), ("mean", math.inf, "finite")):
        stats = dict(good)
        shape = (1,) if part == "count" else (3,)
        dtype = torch.float16 if part == "mean" else torch.float32  # mixed dtypes too
        stats[f"1.{part}"] = torch.full(shape, bad, dtype=dtype)
        with pytest.raises(StatisticsError, match=f"'1'.*{re.escape(why)}|{re.escape(why)}.*'1'"):
            check_statistics(model, stats)
