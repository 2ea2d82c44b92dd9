"""The integer grid: replicas, the quantizer onto it, and catch-ups from its log."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedddl.compression.codecs.count_delta import (
    MAX_COUNT,
    MAX_EXPONENT,
    MIN_EXPONENT,
    CountDelta,
    CountSegment,
)
from fedddl.sync.grid import GridError, GridState, shift_left
from fedddl.sync.grid_log import GridLog
from fedddl.sync.grid_quantizer import GridQuantizer, fitting_exponent

SHAPES = {"layer.weight": (16, 8), "layer.bias": (16,), "head.weight": (3, 16)}


def _initial(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _scale(round_: int) -> float:
    """Step sizes that rise, fall and collapse (exponent raises, lowers, a forced rebase)."""
    if 25 <= round_ < 28:
        return 2.0**-28  # 20+ bits finer: the counts would overflow, so the server rebases
    return 0.01 * 2.0 ** ((round_ // 6) % 4 * 2 - 3)


def _same(a: GridState, b: GridState) -> bool:
    return a.units() == b.units() and all(
        torch.equal(x.anchor, y.anchor) and torch.equal(x.counts, y.counts)
        for x, y in zip(a.tensors.values(), b.tensors.values(), strict=True)
    )


def _stream(
    rounds: int = 60, capacity: int = 50, rebase_every: int = 17, levels: int = 1
) -> tuple[GridState, GridLog, list[CountSegment], dict[int, GridState]]:
    """The server's state, log and updates, and a replica's state at every version
    (a separate replica that applies every round in turn)."""
    server, replica = GridState(_initial()), GridState(_initial())
    quantizer, log = GridQuantizer(levels, seed=3), GridLog(capacity)
    generator = torch.Generator().manual_seed(1)
    updates: list[CountSegment] = []
    states = {0: replica.copy()}
    for t in range(1, rounds + 1):
        steps = {n: torch.randn(s, generator=generator) * _scale(t) for n, s in SHAPES.items()}
        update = quantizer.quantize(t, steps)
        if server.needs_rebase(update) or t % rebase_every == 0:
            update = dataclasses.replace(update, rebase=True)
        server.apply(update)
        replica.apply(update)
        log.append(t, update)
        updates.append(update)
        states[t] = replica.copy()
    return server, log, updates, states


def test_the_stream_covers_rebases_and_exponent_moves() -> None:
    """The stream below is a real test: it rebases on overflow and on schedule, and its
    exponents rise and fall between rebases."""
    _, _, updates, _ = _stream()
    plain = GridState(_initial())
    overflowed = []
    for t, update in enumerate(updates, 1):
        if update.rebase and plain.needs_rebase(dataclasses.replace(update, rebase=False)):
            overflowed.append(t)
        plain.apply(update)
    assert 25 in overflowed or 26 in overflowed
    assert {17, 34, 51} <= {t for t, u in enumerate(updates, 1) if u.rebase}
    exponents = [u.units["layer.weight"] for u in updates]
    assert any(b > a for a, b in itertools.pairwise(exponents))
    assert any(b < a for a, b in itertools.pairwise(exponents))


@pytest.mark.parametrize("behind", [1, 2, 5, 10, 20, 40, 50])
def test_a_catch_up_equals_applying_every_round(behind: int) -> None:
    server, log, updates, states = _stream()
    delta = log.catch_up(60 - behind)
    assert delta is not None and (delta.from_version, delta.to_version) == (60 - behind, 60)
    replica = states[60 - behind].copy()
    replica.apply_catch_up(delta)
    assert _same(replica, server) and _same(replica, states[60])
    for a, b in zip(replica.values().values(), server.values().values(), strict=True):
        assert torch.equal(a, b)
    window = updates[60 - behind :]
    assert len(delta.segments) == 1 + sum(u.rebase for u in window[1:])
    assert delta.segments[0].rebase == window[0].rebase


def test_a_catch_up_to_an_older_version_and_an_empty_one() -> None:
    _, log, _, states = _stream()
    for start, end in [(20, 30), (30, 30), (11, 59)]:
        delta = log.catch_up(start, end)
        assert delta is not None
        replica = states[start].copy()
        replica.apply_catch_up(delta)
        assert _same(replica, states[end])
    assert log.catch_up(60) == CountDelta(60, 60, ())


def test_a_snapshot_rebuilds_the_state_through_the_codec() -> None:
    from fedddl.compression.codecs.counts import decode_counts, encode_counts

    server, _, _, _ = _stream(rounds=17)  # round 17 rebased: every unit is fresh
    for state in (server, GridState(_initial())):
        message = encode_counts(CountDelta(17, 17, (state.snapshot_segment(),)))
        segment = decode_counts(message, state.layout, 1 << 20).segments[0]
        replica = GridState.from_snapshot(state.anchors(), segment)
        assert _same(replica, state)
        update = GridQuantizer(1, seed=5).quantize(
            18, {n: torch.ones(s) for n, s in SHAPES.items()}
        )
        state.apply(update)
        replica.apply(update)
        assert _same(replica, state)


def test_a_client_older_than_the_log_gets_none() -> None:
    _, log, _, _ = _stream()
    assert log.oldest == 10 and log.newest == 60
    assert log.catch_up(9) is None
    assert log.catch_up(10) is not None
    with pytest.raises(ValueError):
        log.catch_up(30, 20)
    with pytest.raises(ValueError):
        log.catch_up(30, 61)
    with pytest.raises(ValueError):
        log.append(62, CountSegment(False, {}, {}))


def test_the_log_keeps_ternary_codes_at_two_bits_a_value() -> None:
    _, log, _, _ = _stream(capacity=50)
    numel = sum(math.prod(s) for s in SHAPES.values())
    assert log.nbytes == 50 * sum(-(-math.prod(s) // 4) for s in SHAPES.values())
    assert log.nbytes < 50 * numel // 3
    _, wide, _, _ = _stream(capacity=10, levels=5)
    assert wide.nbytes <= 10 * numel


def test_values_are_the_anchor_plus_an_exact_product_rounded_once() -> None:
    state = GridState({"w": torch.tensor([1.0, -3.5, 1e-3, 7.25])})
    counts = torch.tensor([5, -MAX_COUNT, 12345, 0], dtype=torch.int32)
    state.apply(CountSegment(False, {"w": -10}, {"w": counts}))
    anchor = torch.tensor([1.0, -3.5, 1e-3, 7.25])
    exact = (anchor.double() + counts.double() * 2.0**-10).float()
    assert torch.equal(state.values()["w"], exact)
    state.rebase()
    assert torch.equal(state.tensors["w"].anchor, exact)
    assert state.units() == {"w": None} and not state.tensors["w"].counts.any()


def test_the_unit_only_refines_and_counts_shift() -> None:
    state = GridState({"w": torch.zeros(2)})
    state.apply(CountSegment(False, {"w": -3}, {"w": torch.tensor([1, -1])}))
    state.apply(CountSegment(False, {"w": -1}, {"w": torch.tensor([1, 0])}))
    assert state.units() == {"w": -3} and state.tensors["w"].counts.tolist() == [5, -1]
    state.apply(CountSegment(False, {"w": -5}, {"w": torch.tensor([0, 1])}))
    assert state.units() == {"w": -5} and state.tensors["w"].counts.tolist() == [20, -3]
    assert state.values()["w"].tolist() == [20 / 32, -3 / 32]


def test_an_overflowing_update_is_refused_whole_and_flagged_for_a_rebase() -> None:
    def segment(unit_a: int, b: int) -> CountSegment:
        zeros, ones = torch.zeros(3, dtype=torch.int32), torch.full((2,), b, dtype=torch.int32)
        return CountSegment(False, {"a": unit_a, "b": 0}, {"a": zeros, "b": ones})

    state = GridState({"a": torch.zeros(3), "b": torch.zeros(2)})
    first = CountSegment(
        False,
        {"a": 0, "b": 0},
        {"a": torch.tensor([1, 0, 0]), "b": torch.zeros(2, dtype=torch.int32)},
    )
    state.apply(first)
    before = state.copy()
    assert not state.needs_rebase(segment(-24, 1))  # 1 << 24 is MAX_COUNT: it fits
    assert state.needs_rebase(segment(-25, 1))  # 1 << 25 does not
    assert state.needs_rebase(segment(0, MAX_COUNT + 1))
    with pytest.raises(GridError, match="overflows"):
        state.apply(segment(-25, 1))
    with pytest.raises(GridError, match="overflows"):
        state.apply(segment(MIN_EXPONENT, 0))  # a shift past int64 is caught too
    assert _same(state, before)
    state.apply(dataclasses.replace(segment(-25, 1), rebase=True))
    assert state.units() == {"a": -25, "b": 0}
    assert torch.equal(state.tensors["a"].anchor, torch.tensor([1.0, 0.0, 0.0]))
    assert not state.needs_rebase(segment(MIN_EXPONENT, 1))  # all of a's counts are zero


@pytest.mark.parametrize(
    ("segment", "match"),
    [
        (CountSegment(False, {"w": 0}, {"v": torch.zeros(2, dtype=torch.int8)}), "tensors"),
        (CountSegment(False, {"w": 0}, {"w": torch.zeros(3, dtype=torch.int8)}), "shape"),
        (CountSegment(False, {"w": 0}, {"w": torch.zeros(2)}), "dtype"),
        (
            CountSegment(False, {"w": MAX_EXPONENT + 1}, {"w": torch.zeros(2, dtype=torch.int8)}),
            "unit",
        ),
        (
            CountSegment(False, {"w": MIN_EXPONENT - 1}, {"w": torch.zeros(2, dtype=torch.int8)}),
            "unit",
        ),
        (CountSegment(False, {"w": 0}, {"w": torch.tensor([2 * MAX_COUNT + 1, 0])}), "delta"),
    ],
)
def test_a_segment_that_does_not_fit_is_refused(segment: CountSegment, match: str) -> None:
    state = GridState({"w": torch.ones(2)})
    before = state.copy()
    with pytest.raises(GridError, match=match):
        state.apply(segment)
    with pytest.raises(GridError):
        state.apply_catch_up(
            CountDelta(
                0,
                2,
                (CountSegment(False, {"w": 0}, {"w": torch.ones(2, dtype=torch.int8)}), segment),
            )
        )
    assert _same(state, before)


def test_shift_left_refuses_what_would_leave_int64() -> None:
    assert shift_left(torch.tensor([3, -1]), 4).tolist() == [48, -16]  # type: ignore[union-attr]
    assert shift_left(torch.tensor([1]), 61) is not None
    assert shift_left(torch.tensor([2]), 61) is None
    assert shift_left(torch.tensor([0, 0]), 500) is not None
    assert shift_left(torch.tensor([1]), 40, limit=40) is None


@given(st.floats(1e-30, 1e30), st.integers(1, 127))
def test_the_fitting_exponent_is_the_smallest_that_fits(peak: float, levels: int) -> None:
    e = fitting_exponent(peak, levels)
    assert peak <= math.ldexp(levels, e) and peak > math.ldexp(levels, e - 1)


@pytest.mark.parametrize("levels", [1, 3])
def test_the_quantizer_is_unbiased(levels: int) -> None:
    x = torch.randn(200, generator=torch.Generator().manual_seed(5)) * 0.01
    runs = 600
    sent = torch.stack(
        [
            (lambda u: u.deltas["x"].double() * 2.0 ** u.units["x"])(
                GridQuantizer(levels, seed=s).quantize(7, {"x": x})
            )
            for s in range(runs)
        ]
    )
    e = fitting_exponent(float(x.abs().max()), levels)
    y = x.double() / 2.0**e
    frac = y - y.floor()
    stderr = (frac * (1 - frac)).sqrt() * 2.0**e / math.sqrt(runs)
    z = (sent.mean(0) - x.double()).abs() / stderr.clamp_min(1e-12)
    assert float(z.max()) < 5.0
    assert int(sent.abs().max() / 2.0**e) <= levels


def test_error_feedback_keeps_a_bounded_residual_and_a_steady_exponent() -> None:
    generator = torch.Generator().manual_seed(2)
    quantizer = GridQuantizer(1, seed=0)
    total_sent, total_wanted = (
        torch.zeros(500, dtype=torch.float64),
        torch.zeros(500, dtype=torch.float64),
    )
    exponents = set()
    for t in range(1, 201):
        x = torch.randn(500, generator=generator) * 1e-3
        update = quantizer.quantize(t, {"x": x})
        e = update.units["x"]
        exponents.add(e)
        assert int(update.deltas["x"].abs().max()) <= 1
        assert float(quantizer.residuals["x"].abs().max()) < 2.0**e
        total_sent += update.deltas["x"].double() * 2.0**e
        total_wanted += x.double()
    # no ratchet: the exponent follows the steps (max ~3 sigma: 2**-8), not the residual
    assert exponents <= {-8, -7}
    gap = total_wanted - total_sent - quantizer.residuals["x"].double()
    assert float(gap.abs().max()) < 1e-5


def test_the_exponent_has_hysteresis() -> None:
    quantizer = GridQuantizer(1, seed=0)
    x = torch.tensor([0.75, -0.1])

    def exponent(t: int, scale: float) -> int:
        return quantizer.quantize(t, {"x": x * scale}).units["x"]

    assert exponent(1, 1.0) == 0  # 0.75 <= 2**0
    assert exponent(2, 0.5) == 0  # 0.375 in [1/4, 1]: kept
    assert exponent(3, 0.3) == -2  # 0.225 < 1/4: lowered to the fit
    assert exponent(4, 1.0) == 0  # 0.75 > 2**-2: raised to the fit
    assert exponent(5, 0.0) == 0  # all zero: kept


def test_clipping_and_saturation_keep_codes_in_range() -> None:
    generator = torch.Generator().manual_seed(4)
    quantizer = GridQuantizer(2, seed=1, clip_sigma=2.5)
    for t in range(1, 30):
        x = torch.randn(1000, generator=generator) ** 3
        update = quantizer.quantize(t, {"x": x})
        assert int(update.deltas["x"].abs().max()) <= 2
        if t == 1:
            clipped = min(float(x.abs().max()), 2.5 * float(x.std(unbiased=False)))
            assert update.units["x"] == fitting_exponent(clipped, 2)
            assert update.units["x"] < fitting_exponent(float(x.abs().max()), 2)
            sent = update.deltas["x"].double() * 2.0 ** update.units["x"]
            assert torch.allclose(sent + quantizer.residuals["x"].double(), x.double(), atol=1e-5)
    with pytest.raises(ValueError, match="non-finite"):
        quantizer.quantize(31, {"x": torch.tensor([math.inf])})
    with pytest.raises(ValueError):
        GridQuantizer(0)
    with pytest.raises(ValueError):
        GridQuantizer(1, clip_sigma=-1.0)


def test_the_codes_are_reproducible_on_any_thread_count() -> None:
    x = {
        "big": torch.randn(300_000, generator=torch.Generator().manual_seed(0)),
        "small": torch.ones(3) / 3,
    }
    threads = torch.get_num_threads()
    try:
        codes = []
        for n in (1, 2):
            torch.set_num_threads(n)
            codes.append(GridQuantizer(1, seed=9).quantize(4, x).deltas)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(codes[0][k], codes[1][k]) for k in x)
    other = GridQuantizer(1, seed=9).quantize(5, x).deltas
    assert not torch.equal(other["big"], codes[0]["big"])


@st.composite
def _rounds(draw: st.DrawFn) -> list[tuple[bool, int, list[int]]]:
    count = draw(st.integers(1, 25))
    return [
        (
            draw(st.booleans()) and draw(st.booleans()),
            draw(st.integers(-12, 4)),
            draw(st.lists(st.integers(-3, 3), min_size=5, max_size=5)),
        )
        for _ in range(count)
    ]


@settings(max_examples=60, deadline=None)
@given(_rounds(), st.data())
def test_any_stream_of_updates_catches_up_exactly(
    rounds: list[tuple[bool, int, list[int]]], data: st.DataObject
) -> None:
    server = GridState({"w": torch.linspace(-1, 1, 5)})
    log = GridLog(len(rounds))
    states = [server.copy()]
    for t, (rebase, e, codes) in enumerate(rounds, 1):
        update = CountSegment(rebase, {"w": e}, {"w": torch.tensor(codes, dtype=torch.int8)})
        if server.needs_rebase(update):
            update = dataclasses.replace(update, rebase=True)
        server.apply(update)
        log.append(t, update)
        states.append(server.copy())
    start = data.draw(st.integers(0, len(rounds)))
    delta = log.catch_up(start)
    assert delta is not None
    replica = states[start].copy()
    replica.apply_catch_up(delta)
    assert _same(replica, server)
    assert torch.equal(replica.values()["w"], server.values()["w"])
