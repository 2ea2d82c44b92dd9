"""Robust aggregation of ternary gradients: each aggregator against a plain reference, the
header scale bound, overflow-safe sums and statistics (no Flower, no training)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedddl.compression import (
    EntryHeader,
    TernaryCompressor,
    decode_update,
    encode_update,
    read_header,
)
from fedddl.compression.backends.statistics import tensor_statistics
from fedddl.defenses import AGGREGATORS, Defenses
from fedddl.sync import ClientReply, Contribution, running_mean
from fedddl.sync.robust import (
    coordinate_median,
    make_aggregator,
    sign_vote,
    trimmed_mean,
)
from fedddl.sync.scale_bound import DEFAULT_WEIGHT, ScaleBound, lower_median

SHAPES = {"w": (6, 5), "b": (5,)}


def _ternary_grads(n: int, seed: int = 0) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """``n`` decoded ternary gradients (values -s, 0, s) and their scales."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        grad, scales = {}, {}
        for name, shape in SHAPES.items():
            scale = float(np.float32(0.5 + torch.rand((), generator=gen).item()))
            grad[name] = scale * torch.randint(-1, 2, shape, generator=gen).to(torch.float32)
            scales[name] = scale
        out.append((grad, scales))
    return out


def _contributions(
    grads: list[tuple[dict[str, torch.Tensor], dict[str, float]]],
) -> list[Contribution]:
    return [
        Contribution(ClientReply(i, 0, "", b"", 1, 0.0), g, s) for i, (g, s) in enumerate(grads)
    ]


def _stack(grads: list[tuple[dict[str, torch.Tensor], dict[str, float]]], name: str) -> np.ndarray:
    return np.stack([g[name].numpy() for g, _ in grads]).astype(np.float64)


@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_median_and_trimmed_mean_match_numpy(n: int) -> None:
    grads = _ternary_grads(n, seed=n)
    median = coordinate_median(_contributions(grads))
    trimmed = trimmed_mean(_contributions(grads), trim_fraction=0.2)
    cut = int(0.2 * n)
    for name in SHAPES:
        values = _stack(grads, name)
        want_median = torch.from_numpy(np.median(values, axis=0)).to(torch.float32)
        torch.testing.assert_close(median.gradient[name], want_median)
        ordered = np.sort(values, axis=0)
        want_trim = torch.from_numpy(ordered[cut : n - cut].mean(axis=0)).to(torch.float32)
        torch.testing.assert_close(trimmed.gradient[name], want_trim)
    assert [r.node_id for r in median.contributors] == list(range(n))
    assert median.code_sums is None and trimmed.code_sums is None


def test_sign_vote_matches_a_reference_and_ignores_scales() -> None:
    grads = _ternary_grads(7, seed=3)
    result = sign_vote(_contributions(grads))
    for name in SHAPES:
        votes = np.sign(_stack(grads, name)).sum(axis=0)
        scale = sorted(s[name] for _, s in grads)[3]  # lower median of 7
        want = torch.from_numpy(np.sign(votes) * scale).to(torch.float32)
        torch.testing.assert_close(result.gradient[name], want)
    # One voter with a huge scale changes no coordinate by more than its one vote.
    attacked = list(grads)
    loud = {k: v * 1e30 for k, v in grads[0][0].items()}
    attacked[0] = (loud, {k: s * 1e30 for k, s in grads[0][1].items()})
    again = sign_vote(_contributions(attacked))
    for name in SHAPES:
        assert float(again.gradient[name].abs().max()) <= max(s[name] for _, s in grads[1:])


def test_mean_is_the_plain_mean_and_make_aggregator_knows_every_name() -> None:
    grads = _ternary_grads(6)
    mean = running_mean(_contributions(grads))
    for name in SHAPES:
        want = torch.stack([g[name] for g, _ in grads]).mean(dim=0)
        torch.testing.assert_close(mean.gradient[name], want)
    assert set(AGGREGATORS) == {"mean", "median", "trimmed-mean", "sign-vote"}
    for name in AGGREGATORS:
        assert make_aggregator(name)(iter(()), None).contributors == []
    with pytest.raises(ValueError, match="aggregator"):
        make_aggregator("krum")
    with pytest.raises(ValueError, match="trim-fraction"):
        make_aggregator("trimmed-mean", trim_fraction=0.5)
    with pytest.raises(ValueError, match="scale-bound"):
        Defenses(scale_bound=0.5)
    with pytest.raises(ValueError, match="scale-bound"):
        Defenses(scale_bound=math.inf)


def test_running_mean_does_not_overflow_and_is_unchanged_below_the_threshold() -> None:
    huge = float(np.finfo(np.float32).max)
    grads = [({"w": torch.full((3,), huge)}, {"w": huge}) for _ in range(4)]
    grads.append(({"w": torch.tensor([-huge, 0.0, huge])}, {"w": huge}))
    result = running_mean(_contributions(grads))
    want = torch.from_numpy(_stack(grads, "w").mean(axis=0)).to(torch.float32)
    assert bool(torch.isfinite(result.gradient["w"]).all())
    torch.testing.assert_close(result.gradient["w"], want)
    # Dense contributions (no scales) are measured instead.
    dense = [Contribution(ClientReply(i, 0, "", b"", 1, 0.0), g) for i, (g, _) in enumerate(grads)]
    torch.testing.assert_close(running_mean(dense).gradient["w"], want)
    # Dense contributions with peaks known from screening use them (no measuring pass), so
    # a known peak that is too low would miss the overflow: the peak is what decides.
    known = [
        Contribution(ClientReply(i, 0, "", b"", 1, 0.0), g, peaks={"w": huge})
        for i, (g, _) in enumerate(grads)
    ]
    torch.testing.assert_close(running_mean(known).gradient["w"], want)
    assert known[0].peak("w") == huge
    understated = [
        Contribution(ClientReply(i, 0, "", b"", 1, 0.0), g, peaks={"w": 1.0})
        for i, (g, _) in enumerate(grads)
    ]
    assert not bool(torch.isfinite(running_mean(understated).gradient["w"]).all())
    # Ordinary values: the float32 accumulation, bit for bit.
    small = _ternary_grads(5)
    total = {k: torch.zeros(v.shape) for k, v in small[0][0].items()}
    for g, _ in small:
        for k in total:
            total[k] += g[k]
    got = running_mean(_contributions(small)).gradient
    for k in total:
        assert torch.equal(got[k], total[k] / 5)


def test_statistics_and_encoding_of_huge_finite_values() -> None:
    values = torch.tensor([3e38, -2e38, 1e19, 0.0] * 100)
    stats = tensor_statistics(values)
    wide = values.numpy().astype(np.float64)
    assert stats.peak == 3e38 * (1 + 0) or math.isclose(stats.peak, float(np.float32(3e38)))
    assert math.isclose(stats.std, float(wide.std()), rel_tol=1e-6)
    decoded = decode_update(encode_update({"a": values}, TernaryCompressor(seed=0)))
    assert bool(torch.isfinite(decoded["a"]).all())
    with pytest.raises(ValueError, match="NaN or Inf"):
        tensor_statistics(torch.tensor([1.0, math.inf]))


def _headers(scales: dict[int, dict[str, float]]) -> dict[int, list[EntryHeader]]:
    return {
        node: [EntryHeader(name, torch.float32, "2bit", (4,), s, 1) for name, s in per.items()]
        for node, per in scales.items()
    }


def test_scale_bound_clips_or_drops_only_the_outlier() -> None:
    honest = {n: {"w": 0.1 + 0.01 * n, "b": 1.0} for n in range(9)}
    attacked = {**honest, 9: {"w": 1e30, "b": 1.0}}
    bound = ScaleBound(factor=8.0, action="clip", rounds=0)
    verdict = bound.screen(_headers(attacked))
    median = lower_median([s["w"] for s in attacked.values()])
    assert verdict.bounds["w"] == pytest.approx(8 * median)
    assert verdict.caps["w"] == pytest.approx(DEFAULT_WEIGHT * median)
    assert verdict.clip == {9: {"w": verdict.caps["w"]}}  # to the cap, not the bound
    assert set(verdict.clipped) == {9}
    assert "1e+30" in verdict.clipped[9] and "'w'" in verdict.clipped[9]
    dropping = ScaleBound(factor=8.0, action="drop", rounds=0).screen(_headers(attacked))
    assert set(dropping.dropped) == {9} and not dropping.clip
    assert not ScaleBound(factor=0).screen(_headers(attacked)).clipped  # off
    # Shared-scale-sum: the told scale is the bound, exactly.
    told = ScaleBound(factor=8.0, rounds=0).screen(_headers(attacked), {"w": 0.12})
    assert told.bounds["w"] == 0.12
    assert set(told.clip) == {n for n in attacked if attacked[n]["w"] > 0.12}


def test_scale_just_under_the_bound_is_clipped_to_the_cap() -> None:
    """A scale at 7.9x the median passes an 8x bound but weighs at most ``weight`` honest
    clients; honest scales within the cap are untouched; ``weight = 0`` is the old bound."""
    honest = {n: {"w": 0.1 + 0.01 * n} for n in range(9)}
    median = lower_median([s["w"] for s in honest.values()])
    attacked = {**honest, 9: {"w": 7.9 * median}}
    verdict = ScaleBound(factor=8.0, rounds=0).screen(_headers(attacked))
    assert verdict.clip == {9: {"w": pytest.approx(DEFAULT_WEIGHT * median)}}
    assert "cap" in verdict.clipped[9]
    for action in ("clip", "drop"):  # under the bound: clipped, never dropped
        assert not ScaleBound(factor=8.0, action=action, rounds=0).screen(
            _headers(attacked)
        ).dropped
    assert not ScaleBound(factor=8.0, rounds=0, weight=0).screen(_headers(attacked)).clip
    with pytest.raises(ValueError, match="scale-weight"):
        ScaleBound(weight=0.5)


def test_scale_bound_history_outvotes_a_round_of_attackers_and_round_trips() -> None:
    bound = ScaleBound(factor=4.0, rounds=3)
    for _ in range(3):
        bound.screen(_headers({n: {"w": 0.1} for n in range(10)}))
    # A round where 7 of 10 replies claim 1e6: the pooled median is still honest.
    verdict = bound.screen(_headers({n: {"w": 1e6 if n < 7 else 0.1} for n in range(10)}))
    assert verdict.bounds["w"] == pytest.approx(0.4)
    assert set(verdict.clipped) == set(range(7))
    copy = ScaleBound(factor=4.0, rounds=3)
    copy.load_state(bound.state())
    assert copy.state() == bound.state()
    with pytest.raises(ValueError, match="bad scale"):
        copy.load_state({"history": [{"w": [math.nan]}]})


def test_read_header_describes_the_message_without_decoding() -> None:
    grads = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    data = encode_update(grads, TernaryCompressor(seed=1, codec="base3"))
    entries = read_header(data)
    decoded = decode_update(data)
    assert [e.name for e in entries] == ["w", "b"]
    for entry in entries:
        assert entry.codec == "base3" and entry.shape == tuple(grads[entry.name].shape)
        assert float(decoded[entry.name].abs().max()) == pytest.approx(entry.scale)
    from fedddl.compression import PayloadError

    with pytest.raises(PayloadError, match="exceeds the limit"):
        read_header(data, max_bytes=len(data) - 1)
    with pytest.raises(PayloadError, match="declares 2 tensors"):
        read_header(data, max_tensors=1)
    with pytest.raises(PayloadError, match="CRC"):
        read_header(data[:-1] + bytes([data[-1] ^ 1]))
