"""TernGrad's kernels in plain torch ops, run on the device of their input: the
device-generic counterparts of :mod:`.statistics`, :mod:`.ternarize`, :mod:`.packing`
and :mod:`.unpacking`.

No kernel copies to or from the host or waits for the device (no ``.item()``), so on a
GPU they only queue work. Codes, packing, the deterministic rule and decoding are those of
the numpy path bit for bit; stochastic rounding uses the same float32 rule with ``r`` from
a seeded :class:`torch.Generator` (in chunks of :data:`CHUNK`); statistics are reduced in
float64 and agree with the numpy path's to rounding error.
"""

from __future__ import annotations

import numpy as np
import torch

from fedddl.compression.backends.packing import codes_per_byte, packed_size

__all__ = [
    "CHUNK",
    "RANDOM_HIGH",
    "pack_codes",
    "random_levels",
    "statistics",
    "stochastic_codes",
    "ternarize_deterministic",
    "ternarize_stochastic",
    "threshold_codes",
    "unpack_codes",
    "value_table",
]

#: Elements per chunk: a multiple of 4 and 5 (only a tensor's last chunk has a partial
#: byte).  Fixed, because the random values a chunk draws depend on where chunks start.
CHUNK = 20 * (1 << 18)
#: Random integers are drawn from ``0 .. RANDOM_HIGH - 1`` (16 bits, as on the CPU).
RANDOM_HIGH = 1 << 16
_UNPACK_CHUNK = 1 << 20  # packed bytes per gather (4-5 M values)


def _chunks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [flat[start : start + size] for start in range(0, flat.numel(), size)]


def statistics(flat: torch.Tensor, with_std: bool = True) -> torch.Tensor:
    """``[max|g|, population std]`` of a 1-D float32 tensor, as a float64 tensor on its device.

    ``max|g|`` is exact (it is one of the values); it is NaN or infinite when any value is
    (the caller checks it).  The standard deviation is NaN when ``with_std`` is false.
    Otherwise it is computed in float64 per chunk (``var_mean``) and combined in chunk
    order with the parallel formula ``M2 = sum M2_i + sum n_i (mean_i - mean)^2``, so its
    relative error is about ``1e-15`` and no finite float32 input overflows it.

    Parameters
    ----------
    flat:
        1-D contiguous float32 tensor with at least one element.
    with_std:
        Whether to compute the standard deviation.
    """
    low, high = torch.aminmax(flat)
    peak = torch.maximum(-low, high).to(torch.float64)
    if not with_std:
        return torch.stack([peak, torch.full_like(peak, float("nan"))])
    numel = flat.numel()
    # (share of the values, variance, mean) per chunk; shares are Python floats, so
    # nothing is copied to the device
    parts = [
        (chunk.numel() / numel, *torch.var_mean(chunk.to(torch.float64), correction=0))
        for chunk in _chunks(flat, CHUNK)
    ]
    mean = sum(share * chunk_mean for share, _, chunk_mean in parts)
    variance = sum(
        share * (chunk_variance + (chunk_mean - mean).square())
        for share, chunk_variance, chunk_mean in parts
    )
    assert isinstance(variance, torch.Tensor)
    return torch.stack([peak, variance.clamp(min=0.0).sqrt()])


def random_levels(
    count: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """``count`` uniform integers in ``0 .. RANDOM_HIGH - 1`` (int32) drawn on ``device``."""
    return torch.randint(
        0, RANDOM_HIGH, (count,), generator=generator, device=device, dtype=torch.int32
    )


def stochastic_codes(
    chunk: torch.Tensor, factor: float, limit: float | None, random: torch.Tensor
) -> torch.Tensor:
    """``uint8`` codes of the stochastic rule for 1-D float32 ``chunk`` and integers ``random``.

    ``factor`` is ``float32(2**16 / s)`` (exactly a float32, so torch's float32 arithmetic
    equals numpy's); ``limit`` is ``float32(clip_bound * factor)`` or ``None`` (no
    clipping); ``random`` holds one integer in ``0 .. RANDOM_HIGH - 1`` per value, on
    ``chunk``'s device.
    """
    level = chunk.abs().mul_(factor)
    if limit is not None:
        level.clamp_(max=limit)
    level.sub_(0.5)
    return _codes(torch.gt(level, random), chunk)


def threshold_codes(chunk: torch.Tensor, cut: float) -> torch.Tensor:
    """``uint8`` codes of the deterministic rule: ``sign(g)`` where ``|g| > cut``."""
    return _codes(torch.gt(chunk.abs(), cut), chunk)


def _codes(fire: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """0 where not firing, 1 where firing and positive, 2 where firing and negative."""
    codes = fire.to(torch.uint8)
    return codes.add_(fire.logical_and_(torch.signbit(chunk)))


def pack_codes(codes: torch.Tensor, codec: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack 1-D ``uint8`` codes in ``{0, 1, 2}`` into bytes, on their device.

    Parameters
    ----------
    codes:
        1-D ``uint8`` codes (not checked: values above 2 give invalid bytes).
    codec:
        ``"2bit"`` or ``"base3"``.
    out:
        Optional 1-D ``uint8`` tensor of :func:`~fedddl.compression.backends.packing.packed_size`
        bytes on the same device to write into.

    Returns
    -------
    torch.Tensor
        ``out``, or a new tensor: the bytes :func:`fedddl.compression.pack_codes` gives.
    """
    per = codes_per_byte(codec)
    numel = codes.numel()
    nbytes = packed_size(numel, codec)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    elif out.numel() != nbytes:
        raise ValueError(f"out has {out.numel()} bytes for {numel} codes (need {nbytes})")
    if nbytes == 0:
        return out
    if numel % per:
        codes = torch.cat([codes, codes.new_zeros(nbytes * per - numel)])
    grid = codes.view(nbytes, per)
    weight = 4 if codec == "2bit" else 3
    out.copy_(grid[:, per - 1])
    for slot in range(per - 2, -1, -1):  # Horner: ((c4 * w + c3) * w + ...) * w + c0
        out.mul_(weight).add_(grid[:, slot])
    return out


def value_table(codec: str, scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``(256, per)`` table of ``float32(scale) * value`` of every byte's codes, cast to
    ``dtype``, built on ``device`` (invalid codes and bytes give 0)."""
    per = codes_per_byte(codec)
    byte = torch.arange(256, dtype=torch.int32, device=device).unsqueeze(1)
    slot = torch.arange(per, dtype=torch.int32, device=device)
    if codec == "2bit":
        code = (byte >> (2 * slot)) & 0b11
    else:
        code = torch.div(byte, 3**slot, rounding_mode="floor") % 3
        code = code.masked_fill(byte >= 3**per, 0)
    value = (code == 1).to(torch.float32) - (code == 2).to(torch.float32)
    return value.mul_(scale).to(dtype)


def unpack_codes(
    packed: torch.Tensor, numel: int, scale: float, codec: str, out: torch.Tensor
) -> None:
    """Write ``scale * value`` of packed codes into ``out``, on ``out``'s device.

    Parameters
    ----------
    packed:
        1-D ``uint8`` packed codes on ``out``'s device (their validity is the caller's
        check: invalid codes decode to 0).
    numel, scale, codec:
        What the codes describe; ``scale`` must be exactly a float32.
    out:
        Contiguous 1-D tensor of ``numel`` elements of any floating dtype; values are
        ``float32(scale) * code`` cast to that dtype, bit-identical to
        :func:`fedddl.compression.unpack_codes` followed by ``.to(dtype)``.
    """
    per = codes_per_byte(codec)
    if packed.numel() != packed_size(numel, codec) or out.numel() != numel:
        raise ValueError(
            f"{packed.numel()} code bytes and {out.numel()} outputs for {numel} values"
        )
    if numel == 0:
        return
    table = value_table(codec, scale, out.dtype, out.device)
    whole = numel // per
    rows = out[: whole * per].view(whole, per)
    for start in range(0, whole, _UNPACK_CHUNK):
        stop = min(start + _UNPACK_CHUNK, whole)
        index = packed[start:stop].to(torch.int32)
        torch.index_select(table, 0, index, out=rows[start:stop])
    used = numel - whole * per
    if used:
        last = packed[whole:].to(torch.int32)
        out[whole * per :].copy_(torch.index_select(table, 0, last)[0, :used])


def ternarize_stochastic(
    flat: torch.Tensor,
    scale: float,
    clip_bound: float | None,
    generator: torch.Generator | None,
    codec: str,
    out: torch.Tensor,
) -> None:
    """Stochastically ternarise 1-D contiguous finite float32 ``flat``; pack the codes into ``out``.

    ``scale`` is the scaler ``s > 0`` (exactly a float32); ``clip_bound`` clips ``|g|`` first
    when below ``scale``; ``generator`` lives on ``flat``'s device (``None``: the device's
    default); ``out`` is ``uint8`` of ``packed_size(flat.numel(), codec)`` bytes on that
    device. Draws ``flat.numel()`` random integers, one call per :data:`CHUNK` values, so the
    codes depend only on the seed, the generator's history and the device's algorithm.
    """
    factor = _float32(RANDOM_HIGH / scale)
    limit = None if clip_bound is None or clip_bound >= scale else _float32(clip_bound * factor)
    per = codes_per_byte(codec)
    for index, chunk in enumerate(_chunks(flat, CHUNK)):
        random = random_levels(chunk.numel(), generator, flat.device)
        codes = stochastic_codes(chunk, factor, limit, random)
        first = index * CHUNK // per
        pack_codes(codes, codec, out[first : first + packed_size(chunk.numel(), codec)])


def ternarize_deterministic(
    flat: torch.Tensor,
    scale: float,
    clip_bound: float | None,
    threshold: float,
    codec: str,
    out: torch.Tensor,
) -> None:
    """Deterministically ternarise ``flat`` into ``out``: ``sign(g)`` where
    ``|g_clipped| > float32(threshold * s)`` (arguments as :func:`ternarize_stochastic`)."""
    cut = _float32(threshold * scale)
    if clip_bound is not None and clip_bound <= cut:
        out.zero_()  # every clipped magnitude is at most the cut
        return
    per = codes_per_byte(codec)
    for index, chunk in enumerate(_chunks(flat, CHUNK)):
        first = index * CHUNK // per
        target = out[first : first + packed_size(chunk.numel(), codec)]
        pack_codes(threshold_codes(chunk, cut), codec, target)


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as the numpy path's ``np.float32`` does (so
    torch's float32 arithmetic with it as a scalar uses exactly the same constant)."""
    with np.errstate(over="ignore"):  # a scale near float32's smallest gives factor inf
        return float(np.float32(value))
