"""The count-delta message (``FDGC``): round trips, and every malformed message refused."""

from __future__ import annotations

import struct
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedddl.compression import PayloadError
from fedddl.compression.codecs import counts as codec
from fedddl.compression.codecs.count_delta import MAX_DELTA, CountDelta, CountSegment
from fedddl.compression.codecs.count_widths import (
    WIDTHS,
    narrowest_width,
    pack_integers,
    unpack_integers,
)
from fedddl.compression.codecs.counts import decode_counts, encode_counts, layout_digest
from fedddl.compression.codecs.zstd_frame import compress_frame
from fedddl.framing import seal

LAYOUT = {"layer.weight": (6, 5), "layer.bias": (6,), "head.weight": (2, 6)}
LIMIT = 1 << 20
_HEAD = struct.Struct("<4sBBIHHIII")


def _segment(
    rebase: bool, scale: int, seed: int, units: tuple[int, int, int] = (-7, -9, 3)
) -> CountSegment:
    generator = torch.Generator().manual_seed(seed)
    deltas = {
        name: (torch.randn(shape, generator=generator) * scale).round().to(torch.int32)
        for name, shape in LAYOUT.items()
    }
    return CountSegment(rebase, dict(zip(LAYOUT, units, strict=True)), deltas)


def _delta() -> CountDelta:
    """Five segments whose tensors need every width: 0 (an all-zero tensor), 2 (ternary),
    4, 8, 16 and 32 bits."""
    wide = _segment(True, 3_000_000, 2)
    ternary = _segment(False, 1, 5)
    ternary = CountSegment(
        False, ternary.units, {n: d.clamp(-1, 1) for n, d in ternary.deltas.items()}
    )
    zero = dict(wide.deltas, **{"layer.bias": torch.zeros(6, dtype=torch.int32)})
    return CountDelta(
        40,
        47,
        (
            ternary,
            _segment(False, 3, 0),
            _segment(False, 20, 3),
            _segment(True, 2000, 1),
            CountSegment(True, wide.units, zero),
        ),
    )


def _equal(a: CountDelta, b: CountDelta) -> bool:
    return (a.from_version, a.to_version, len(a.segments)) == (
        b.from_version,
        b.to_version,
        len(b.segments),
    ) and all(
        x.rebase == y.rebase
        and dict(x.units) == dict(y.units)
        and all(torch.equal(x.deltas[n], y.deltas[n]) for n in LAYOUT)
        for x, y in zip(a.segments, b.segments, strict=True)
    )


def _message(
    body: bytes,
    *,
    segments: int = 1,
    size: int | None = None,
    frame: bytes | None = None,
    tensors: int = len(LAYOUT),
    magic: bytes = codec.MAGIC,
    version: int = codec.VERSION,
    flags: int = 0,
    versions: tuple[int, int] = (1, 2),
) -> bytes:
    """A hand-made message around ``body`` (correct CRC unless changed afterwards)."""
    head = _HEAD.pack(
        magic, version, flags, layout_digest(LAYOUT), tensors, segments, *versions,
        len(body) if size is None else size,
    )  # fmt: skip
    return seal(head + (compress_frame(body) if frame is None else frame))


def _head(
    rebase: int = 0, units: tuple[int, ...] = (0, 0, 0), widths: tuple[int, ...] = (8, 8, 8)
) -> bytes:
    return bytes([rebase]) + b"".join(
        struct.pack("<hB", u, w) for u, w in zip(units, widths, strict=True)
    )


_NUMELS = (30, 6, 12)


def _body(
    rebase: int = 0, units: tuple[int, ...] = (0, 0, 0), widths: tuple[int, ...] = (8, 8, 8)
) -> bytes:
    return _head(rebase, units, widths) + b"".join(
        bytes(-(-n * w // 8)) for n, w in zip(_NUMELS, widths, strict=True)
    )


def test_a_round_trip_is_exact_for_every_width() -> None:
    delta = _delta()
    data = encode_counts(delta)
    assert _equal(decode_counts(data, LAYOUT, LIMIT), delta)
    assert _equal(decode_counts(memoryview(bytearray(data)), LAYOUT, LIMIT), delta)
    widths = {narrowest_width(t) for s in delta.segments for t in s.deltas.values()}
    assert widths == set(WIDTHS)


def test_an_empty_delta_and_a_well_formed_hand_made_message() -> None:
    empty = CountDelta(5, 5, ())
    assert _equal(decode_counts(encode_counts(empty, LAYOUT), LAYOUT, LIMIT), empty)
    with pytest.raises(ValueError, match="layout"):
        encode_counts(empty)
    decoded = decode_counts(_message(_body(units=(1, -126, 103))), LAYOUT, LIMIT)
    assert decoded.segments[0].units == {"layer.weight": 1, "layer.bias": -126, "head.weight": 103}


def test_sparse_ternary_deltas_cost_less_than_base3_packing() -> None:
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-1, 2, (10_000,), generator=generator)
    codes[torch.rand(10_000, generator=generator) < 0.55] = 0  # 70 % zeros: 1.16 bits of entropy
    size = len(encode_counts(CountDelta(0, 1, (CountSegment(False, {"w": -8}, {"w": codes}),))))
    assert size < 10_000 * 1.6 / 8  # base-3 packing: 1.6 bits a value


@pytest.mark.parametrize(
    ("delta", "match"),
    [
        (
            CountDelta(
                0, 1, (CountSegment(False, {"w": 200}, {"w": torch.zeros(2, dtype=torch.int32)}),)
            ),
            "unit",
        ),
        (
            CountDelta(
                0, 1, (CountSegment(False, {"w": 0}, {"w": torch.tensor([MAX_DELTA + 1])}),)
            ),
            "delta",
        ),
        (CountDelta(3, 1, ()), "versions"),
        (CountDelta(0, 1 << 32, ()), "versions"),
    ],
)
def test_the_encoder_refuses_what_the_decoder_would(delta: CountDelta, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_counts(delta, {"w": (2,)})


def test_four_bit_values_round_trip_and_their_padding_is_checked() -> None:
    values = torch.tensor([-8, 7, 0, -1, 3])
    assert narrowest_width(values) == 4 and narrowest_width(torch.tensor([8])) == 8
    packed = pack_integers(values, 4)
    assert len(packed) == 3
    unpacked = unpack_integers(memoryview(packed), 5, 4)
    assert not isinstance(unpacked, str) and unpacked.tolist() == values.tolist()
    bad = packed[:2] + bytes([packed[2] | 0x10])
    assert unpack_integers(memoryview(bad), 5, 4) == "nonzero padding after the last 4-bit value"


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x40]) + data[index + 1 :]


@pytest.mark.parametrize(
    ("make", "layout", "match"),
    [
        (lambda: encode_counts(_delta())[:20], LAYOUT, "truncated"),
        (lambda: _message(_body(), magic=b"FDTQ"), LAYOUT, "bad magic"),
        (lambda: _message(_body(), version=2), LAYOUT, "unsupported format version"),
        (lambda: _flip(encode_counts(_delta()), 40), LAYOUT, "checksum"),
        (lambda: _message(_body(), flags=1), LAYOUT, "flags"),
        (lambda: encode_counts(_delta()), dict(LAYOUT, **{"head.weight": (6, 2)}), "layout"),
        (
            lambda: encode_counts(_delta()),
            {"a": (6, 5), "layer.bias": (6,), "head.weight": (2, 6)},
            "layout",
        ),
        (lambda: encode_counts(_delta()), dict(LAYOUT, extra=(1,)), "layout"),
        (lambda: _message(_body(), versions=(9, 2)), LAYOUT, "from version"),
        (lambda: _message(_body(), size=LIMIT + 1), LAYOUT, "over the limit"),
        (lambda: _message(_body(), size=1 + 3 * 3 + 4 * 48 + 1), LAYOUT, "over the limit"),
        (lambda: _message(_body(), size=len(_body()) - 1), LAYOUT, "declares"),
        (lambda: _message(_body(), frame=compress_frame(_body()) + b"\0"), LAYOUT, "ends at byte"),
        (
            lambda: _message(_body(), frame=compress_frame(_body())[:-3]),
            LAYOUT,
            "truncated|ends at",
        ),
        (lambda: _message(_body(rebase=2)), LAYOUT, "rebase flag 2"),
        (lambda: _message(_head(widths=(3, 8, 8)) + bytes(12 + 6 + 12)), LAYOUT, "width 3 bits"),
        (lambda: _message(_body(units=(0, -127, 0))), LAYOUT, "unit -127"),
        (lambda: _message(_body(units=(104, 0, 0))), LAYOUT, "unit 104"),
        (lambda: _message(_body() + b"\0"), LAYOUT, "body holds"),
        (lambda: _message(_body(), segments=2), LAYOUT, "body holds 58 bytes, its heads need 68"),
        (lambda: _message(_head(widths=(0, 0, 0)), segments=2), LAYOUT, "too few for 2 heads"),
        (lambda: _message(_head(widths=(2, 0, 0)) + b"\x03" + bytes(7)), LAYOUT, "invalid ternary"),
        (lambda: _message(_head(widths=(2, 0, 0)) + bytes(7) + b"\x10"), LAYOUT, "padding"),
        (
            lambda: _message(
                _head(widths=(32, 8, 8)) + struct.pack("<i", MAX_DELTA + 1) + bytes(116 + 18)
            ),
            LAYOUT,
            "beyond",
        ),
    ],
)
def test_a_malformed_message_is_refused_by_name(
    make: object, layout: dict[str, tuple[int, ...]], match: str
) -> None:
    assert callable(make)
    data = make()
    with pytest.raises(PayloadError, match=match):
        decode_counts(data, layout, LIMIT)


def test_a_message_over_max_bytes_is_refused() -> None:
    data = encode_counts(_delta())
    with pytest.raises(PayloadError, match="over the limit"):
        decode_counts(data, LAYOUT, len(data) - 1)
    body_size = _HEAD.unpack_from(data)[-1]
    with pytest.raises(PayloadError, match="over the limit"):
        decode_counts(data, LAYOUT, body_size - 1)


@pytest.mark.parametrize(
    ("declared_in_head", "match"), [(16 << 20, "over the limit"), (17, "declares 16777216 bytes")]
)
def test_a_decompression_bomb_is_refused_before_it_expands(
    declared_in_head: int, match: str
) -> None:
    """A ~600-byte frame of 16 MiB of zeros: refused by the declared sizes, without
    decompressing (the head's size is over the layout's bound, or the frame's is not it)."""
    frame = compress_frame(bytes(16 << 20), level=1)
    assert len(frame) < 4096
    data = _message(b"", size=declared_in_head, frame=frame)
    started = time.perf_counter()
    with pytest.raises(PayloadError, match=match):
        decode_counts(data, LAYOUT, 1 << 30)
    assert time.perf_counter() - started < 0.05


_SETTINGS = settings(max_examples=60, deadline=None)
_MESSAGE = encode_counts(_delta())


@_SETTINGS
@given(st.integers(0, len(_MESSAGE) - 1), st.integers(1, 255))
def test_any_changed_byte_is_refused(index: int, change: int) -> None:
    data = _MESSAGE[:index] + bytes([_MESSAGE[index] ^ change]) + _MESSAGE[index + 1 :]
    with pytest.raises(PayloadError):
        decode_counts(data, LAYOUT, LIMIT)


@_SETTINGS
@given(st.integers(0, len(_MESSAGE) - 1))
def test_any_truncation_is_refused(length: int) -> None:
    with pytest.raises(PayloadError):
        decode_counts(_MESSAGE[:length], LAYOUT, LIMIT)


@_SETTINGS
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(-126, 103),
            st.lists(st.integers(-MAX_DELTA, MAX_DELTA), min_size=4, max_size=4),
        ),
        max_size=4,
    ),
    st.integers(0, 1000),
)
def test_any_delta_round_trips(segments: list[tuple[bool, int, list[int]]], start: int) -> None:
    delta = CountDelta(
        start,
        start + len(segments),
        tuple(
            CountSegment(r, {"w": u}, {"w": torch.tensor(v, dtype=torch.int32).reshape(2, 2)})
            for r, u, v in segments
        ),
    )
    decoded = decode_counts(encode_counts(delta, {"w": (2, 2)}), {"w": (2, 2)}, LIMIT)
    assert (decoded.from_version, decoded.to_version) == (delta.from_version, delta.to_version)
    for a, b in zip(decoded.segments, delta.segments, strict=True):
        assert (
            a.rebase == b.rebase
            and a.units == b.units
            and torch.equal(a.deltas["w"], b.deltas["w"])
        )


@_SETTINGS
@given(st.lists(st.integers(-9, 9) | st.integers(-40_000, 40_000), max_size=23))
def test_any_integers_pack_and_unpack_at_their_narrowest_width(values: list[int]) -> None:
    tensor = torch.tensor(values, dtype=torch.int64)
    bits = narrowest_width(tensor)
    unpacked = unpack_integers(memoryview(pack_integers(tensor, bits)), len(values), bits)
    assert not isinstance(unpacked, str) and unpacked.tolist() == values
