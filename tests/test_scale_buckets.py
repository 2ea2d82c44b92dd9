"""Ternary codes with one scale per bucket of values (``scale-bucket``): exact decoding,
reproducible bytes, the version-2 wire format and its refusals, the server's scale bound."""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.attacks import attacker_partitions
from fedddl.compression import (
    BUCKETS_VERSION,
    FORMAT_VERSION,
    PayloadError,
    PayloadLimitError,
    TernaryCompressor,
    decode_update,
    encode_update,
    make_compressor,
    open_message,
    read_header,
)
from fedddl.compression.algorithms.ternary_buckets import PER_CHANNEL, bucket_of
from fedddl.flower.delta_protocol import META, parse_broadcast
from fedddl.flower.delta_protocol import Broadcast as DeltaMeta
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.ternary_delta import TernaryDelta
from fedddl.gossip.compressed import ReceiverCopies, SenderCopies
from fedddl.models import create_model
from fedddl.sync.errors import PayloadRejected
from fedddl.sync.messages import ClientReply
from fedddl.sync.reply_checks import Screened, apply_clip, bucket_peaks
from fedddl.sync.scale_bound import ScaleBound
from fedddl.sync.screening import PayloadSpec
from strategies.server_app import run_server

PREFIX = struct.Struct("<4sBBIQ")


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0.01, 4.0, 2000)  # buckets of very different magnitudes
    return {
        "conv": torch.randn(16, 8, 3, 3, generator=generator),
        "bias": torch.randn(16, generator=generator),
        "ramp": torch.randn(2000, generator=generator) * ramp,
    }


def _reseal(data: bytes) -> bytes:
    """``data`` with its CRC recomputed (to reach the checks after the CRC)."""
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _ramp_offset(data: bytes) -> int:
    """Where the data of the last entry (``ramp``, with buckets) starts."""
    entries = read_header(data)
    return len(data) - 4 - entries[-1].data_bytes


@pytest.mark.parametrize("codec", ["2bit", "base3"])
@pytest.mark.parametrize("scale_bucket", [64, 100, PER_CHANNEL])
@pytest.mark.parametrize("deterministic", [False, True])
def test_round_trip_is_exact_per_bucket(codec: str, scale_bucket: int, deterministic: bool) -> None:
    tensors = _tensors()
    compressor = TernaryCompressor(
        seed=3, codec=codec, scale_bucket=scale_bucket, deterministic=deterministic
    )
    message = encode_update(tensors, compressor)
    assert message[4] == BUCKETS_VERSION
    decoded = decode_update(message)
    # the sender's view (error feedback) is bit for bit what the receiver decodes
    again = TernaryCompressor(
        seed=3, codec=codec, scale_bucket=scale_bucket, deterministic=deterministic
    )
    for (name, tensor), (payload, ctx) in zip(
        tensors.items(), again.compress_batch(list(tensors.values())), strict=True
    ):
        assert torch.equal(again.decompress(payload, ctx), decoded[name])
        assert decoded[name].shape == tensor.shape
    entries = {e.name: e for e in read_header(message)}
    for name, tensor in tensors.items():
        bucket = bucket_of(tuple(tensor.shape), scale_bucket)
        assert entries[name].bucket == bucket
        if not bucket:
            continue
        flat, values = tensor.reshape(-1), decoded[name].reshape(-1)
        std = float(flat.std(unbiased=False))
        clipped = flat.clamp(-2.5 * std, 2.5 * std)
        largest = 0.0
        for start in range(0, flat.numel(), bucket):
            part = values[start : start + bucket]
            scale = float(part.abs().max())  # the bucket's largest value always fires
            assert scale == pytest.approx(float(clipped[start : start + bucket].abs().max()))
            largest = max(largest, scale)
            assert set(part.unique().tolist()) <= {-scale, 0.0, scale}
            signs = torch.sign(part) * torch.sign(flat[start : start + bucket])
            assert bool((signs >= 0).all())  # a code never has the wrong sign
        assert entries[name].scale == largest
    # into buffers of other dtypes: the same values, cast
    out = {k: torch.empty_like(v, dtype=torch.float64) for k, v in tensors.items()}
    decode_update(message, out=out)
    assert all(torch.equal(out[k], decoded[k].double()) for k in tensors)


def test_buckets_follow_magnitudes_and_stay_unbiased() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    x *= torch.linspace(0.01, 3.0, 4096)
    mean_bucketed, mean_tensor = torch.zeros_like(x), torch.zeros_like(x)
    draws = 300
    for seed in range(draws):
        for bucket, mean in ((512, mean_bucketed), (0, mean_tensor)):
            c = TernaryCompressor(seed=seed, clip_sigma=None, scale_bucket=bucket)
            mean += decode_update(encode_update({"x": x}, c))["x"] / draws
    # unbiased: the mean of many draws approaches x, closer than with one scale (less
    # variance where the values are small)
    small = slice(0, 512)
    error_bucketed = float((mean_bucketed - x)[small].abs().mean())
    error_tensor = float((mean_tensor - x)[small].abs().mean())
    assert error_bucketed < 0.025
    assert error_bucketed < error_tensor / 2
    assert abs(float((mean_bucketed - x).mean())) < 0.01  # no bias over all the values


def test_same_seed_same_bytes_at_any_thread_count() -> None:
    big = {"w": torch.randn(70_000, generator=torch.Generator().manual_seed(2)), **_tensors()}
    threads = torch.get_num_threads()
    messages = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            messages.append(encode_update(big, TernaryCompressor(seed=5, scale_bucket=512)))
    finally:
        torch.set_num_threads(threads)
    assert messages[0] == messages[1] == messages[2]
    other = encode_update(big, TernaryCompressor(seed=6, scale_bucket=512))
    assert other != messages[0]


def test_per_tensor_is_todays_version_1_message() -> None:
    tensors = _tensors()
    plain = encode_update(tensors, TernaryCompressor(seed=1, codec="base3"))
    zero = encode_update(tensors, TernaryCompressor(seed=1, codec="base3", scale_bucket=0))
    assert plain == zero and plain[4] == FORMAT_VERSION
    # a tensor with a single bucket is a plain entry: a message of such tensors stays v1
    small = {"a": torch.randn(300), "b": torch.randn(7)}
    one = encode_update(small, TernaryCompressor(seed=1, scale_bucket=512))
    assert one == encode_update(small, TernaryCompressor(seed=1)) and one[4] == FORMAT_VERSION


def test_bucket_sizes_cost_four_bytes_per_bucket() -> None:
    tensors = _tensors()
    plain = encode_update(tensors, TernaryCompressor(seed=1))
    bucketed = encode_update(tensors, TernaryCompressor(seed=1, scale_bucket=100))
    buckets = math.ceil(1152 / 100) + math.ceil(2000 / 100)
    assert len(bucketed) - len(plain) == 4 * buckets + 2 * 4  # scales + two u32 sizes


def test_version_1_with_a_bucket_kind_is_refused_not_misread() -> None:
    message = encode_update(_tensors(), TernaryCompressor(seed=1, scale_bucket=100))
    as_v1 = _reseal(message[:4] + bytes([FORMAT_VERSION]) + message[5:])
    with pytest.raises(PayloadError, match="needs format version 2"):
        decode_update(as_v1)
    with pytest.raises(PayloadError, match="unsupported format version 3"):
        decode_update(_reseal(message[:4] + bytes([3]) + message[5:]))


def test_bad_bucket_data_is_refused_and_nothing_is_written() -> None:
    tensors = _tensors()
    message = encode_update(tensors, TernaryCompressor(seed=1, scale_bucket=100))
    start = _ramp_offset(message)
    cases = {
        "non-finite bucket scale": struct.pack("<f", math.nan),
        "negative bucket scale": struct.pack("<f", -1.0),
        "is not the header's scale": struct.pack("<f", 1e30),
    }
    for problem, raw in cases.items():
        bad = _reseal(message[:start] + raw + message[start + 4 :])
        out = {k: torch.full_like(v, 7.0) for k, v in tensors.items()}
        with pytest.raises(PayloadError, match=problem):
            decode_update(bad, out=out)
        assert all(bool((v == 7.0).all()) for v in out.values())  # all or nothing
    with pytest.raises(PayloadError, match="CRC"):
        decode_update(message[:start] + struct.pack("<f", 0.0) + message[start + 4 :])
    for length in (len(message) - 5, len(message) // 2, 30):
        with pytest.raises(PayloadError):
            decode_update(message[:length])


def test_bucket_size_zero_and_the_limits_are_refused() -> None:
    tensors = _tensors()
    message = encode_update(tensors, TernaryCompressor(seed=1, scale_bucket=100))
    # the ramp's bucket size: the last u32 before the conv's... find it by its value
    where = message.find(struct.pack("<I", 100), PREFIX.size)
    zeroed = _reseal(message[:where] + struct.pack("<I", 0) + message[where + 4 :])
    with pytest.raises(PayloadError, match="bucket size 0"):
        decode_update(zeroed)
    values = sum(t.numel() for t in tensors.values())
    with pytest.raises(PayloadLimitError, match="max_values"):
        decode_update(message, max_values=values - 1)
    with pytest.raises(PayloadLimitError, match="max_tensors"):
        open_message(message, max_tensors=2)
    with pytest.raises(PayloadLimitError, match="max_bytes"):
        read_header(message, max_bytes=len(message) - 1)
    assert len(decode_update(message, max_values=values, max_tensors=3)) == 3


def test_entropy_coding_and_shared_scales_need_one_scale() -> None:
    with pytest.raises(ValueError, match="scale_bucket=0"):
        make_compressor("ternary-entropy", seed=0, clip_sigma=2.5, scale_bucket=512)
    with pytest.raises(ValueError, match="shared scales"):
        TernaryCompressor(scale_bucket=64).compress(torch.randn(1000), scale=10.0)
    with pytest.raises(ValueError, match="scale_bucket"):
        TernaryCompressor(scale_bucket=-2)
    with pytest.raises(ValueError, match="shared-scale sum"):
        AppConfig(scale_bucket=512, downlink="shared-scale-sum")
    built = make_compressor("ternary-threshold-base3", seed=1, clip_sigma=2.5, scale_bucket=-1)
    assert isinstance(built, TernaryCompressor) and built.scale_bucket == PER_CHANNEL
    assert make_compressor("identity", seed=0, clip_sigma=2.5, scale_bucket=512).name == "identity"


def test_spec_refuses_other_bucket_sizes() -> None:
    tensors = _tensors()
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    spec = PayloadSpec.for_shapes(shapes, TernaryCompressor(scale_bucket=100))
    spec.check(encode_update(tensors, TernaryCompressor(seed=1, scale_bucket=100)), node=1)
    with pytest.raises(PayloadRejected, match="buckets of 1 values, expected 100"):
        spec.check(encode_update(tensors, TernaryCompressor(seed=1, scale_bucket=1)), node=1)
    with pytest.raises(PayloadRejected, match="buckets of 0 values, expected 100"):
        spec.check(encode_update(tensors, TernaryCompressor(seed=1)), node=1)


def test_the_scale_bound_caps_every_bucket_of_a_clipped_reply() -> None:
    tensors = _tensors()
    honest = [
        read_header(encode_update(tensors, TernaryCompressor(seed=s, scale_bucket=100)))
        for s in range(4)
    ]
    loud = {k: v * 1000 for k, v in tensors.items()}
    message = encode_update(loud, TernaryCompressor(seed=9, scale_bucket=100))
    entries = read_header(message)
    headers = dict(enumerate([*honest, entries]))
    verdict = ScaleBound(factor=8.0, rounds=0).screen(headers)
    assert set(verdict.clip) == {4}  # the bound is on the largest bucket scale
    cap = verdict.clip[4]["ramp"]
    values = decode_update(message)
    before = values["ramp"].clone()
    scales: dict[str, float] = {}
    peaks = bucket_peaks(entries)
    assert peaks["ramp"] == entries[-1].scale
    reply = ClientReply(
        node_id=4, model_version=0, fingerprint="", payload=message, num_examples=1, loss=0.0
    )
    item = Screened(reply, open_message(message), verdict.clip[4])
    apply_clip(item, values, scales, peaks)
    # each bucket's scale is at most the cap, the signs are kept, buckets under it unchanged
    assert float(values["ramp"].abs().max()) <= float(np.float32(cap))
    assert torch.equal(torch.sign(values["ramp"]), torch.sign(before))
    under = before.abs() <= cap
    assert torch.equal(values["ramp"][under], before[under])
    assert peaks["ramp"] == cap


def _run(rounds: int, **settings: Any) -> dict[str, Any]:
    cfg = AppConfig(num_server_rounds=rounds, min_available_nodes=5, **settings)
    grid = InlineGrid(make_client_app(cfg), 5)
    result: dict[str, Any] = run_server(grid, cfg, progress=lambda line: None)
    json.dumps(result, allow_nan=False)
    return result


def test_a_terngrad_run_with_buckets_learns_and_clips_a_huge_scale() -> None:
    # the scale bound alone (the norm clip, on by default, also clips honest replies)
    clean = _run(6, scale_bucket=16, norm_clip=0.0)
    plain = _run(6, scale_bucket=0, norm_clip=0.0)
    for r, p in zip(clean["rounds"], plain["rounds"], strict=True):
        assert not r["dropped"] and not r["clipped"] and r["replicas_equal"]
        assert r["bytes_up"] > p["bytes_up"]  # the bucket scales
    assert clean["final_accuracy"] > clean["initial"]["accuracy"] + 0.1
    assert clean["final_accuracy"] > plain["final_accuracy"] - 0.10
    attacked = _run(6, scale_bucket=16, attack="scale:1e6", num_attackers=1, norm_clip=0.0)
    bad = {str(1000 + pid) for pid in attacker_partitions(5, 1, 0)}
    for r in attacked["rounds"]:
        assert set(r["clipped"]) == bad and not r["dropped"], r
    assert attacked["final_accuracy"] > clean["final_accuracy"] - 0.10


def test_compressed_gossip_sends_bucketed_differences() -> None:
    initial = {k: v.clone() for k, v in create_model("digits", seed=0).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    model = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in initial.items()}
    sender = SenderCopies("ternary-base3", initial, seed=1, scale_bucket=64)
    receiver = ReceiverCopies(initial)
    for _ in range(5):
        update = sender.prepare(5, model)
        assert update.payload[4] == BUCKETS_VERSION
        copy = receiver.apply(3, update.header, update.payload)
        sender.commit(update)
        assert all(torch.equal(copy[k], sender.copy_at(5)[k]) for k in copy)  # bit-identical
    with pytest.raises(ValueError, match="scale_bucket"):
        SenderCopies("ternary-entropy", initial, seed=1, scale_bucket=64)


def test_ternary_delta_tells_the_nodes_its_scale_buckets() -> None:
    record = DeltaMeta(
        record="arrays", names=["w"], version=1, base=-1, digest="", compressor="ternary",
        clip_sigma=2.5, error_feedback=True, seed=0, scale_bucket=-1,
    ).to_record()
    assert record["scale-bucket"] == -1
    content = RecordDict({META: record, "arrays": ArrayRecord()})
    assert parse_broadcast(content).scale_bucket == -1
    del record["scale-bucket"]  # a server without buckets: the key is not sent
    assert parse_broadcast(RecordDict({META: record, "arrays": ArrayRecord()})).scale_bucket == 0
    record["scale-bucket"] = -3
    with pytest.raises(ValueError, match="scale-bucket"):
        parse_broadcast(RecordDict({META: record, "arrays": ArrayRecord()}))
    threshold = "ternary-threshold-base3"
    with pytest.raises(ValueError, match="scale_bucket"):
        TernaryDelta(FedAvg(), scale_bucket=-2, compressor=threshold)
    bucketed = TernaryDelta(FedAvg(), scale_bucket=512, compressor=threshold)
    assert bucketed.broadcast.scale_bucket == 512
    # the default compressor has one scale per tensor: buckets are refused, naming it
    with pytest.raises(ValueError, match=r"quinary-projected-base5.*does not take scale_bucket"):
        TernaryDelta(FedAvg(), scale_bucket=512)


def test_the_bucket_size_depends_on_the_shape_alone() -> None:
    zeros = {"w": torch.zeros(300), "v": torch.zeros(2, 3)}
    message = encode_update(zeros, TernaryCompressor(seed=0, scale_bucket=100))
    assert [e.bucket for e in read_header(message)] == [100, 0]
    assert all(bool((t == 0).all()) for t in decode_update(message).values())


def test_mutated_bucket_messages_raise_payload_errors_only() -> None:
    tensors = _tensors()
    message = encode_update(tensors, TernaryCompressor(seed=1, codec="base3", scale_bucket=100))
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(300):
        data = bytearray(message)
        for where in rng.integers(5, len(data) - 4, size=int(rng.integers(1, 4))):
            data[where] = int(rng.integers(0, 256))
        out = {k: torch.full_like(v, 7.0) for k, v in tensors.items()}
        try:
            decoded = decode_update(_reseal(bytes(data)), out=out)
        except PayloadError:
            refused += 1
            assert all(bool((v == 7.0).all()) for v in out.values())
            continue
        for name, tensor in decoded.items():  # accepted: the header's scale bounds it
            assert tensor.shape == tensors[name].shape and bool(torch.isfinite(tensor).all())
    assert refused > 100
