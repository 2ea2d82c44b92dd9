"""The adaptive attacker: opposes the honest direction only as far as the direction check lets it.

The direction check (:mod:`fedddl.sync.direction`) drops a reply whose signs agree with the
others' majority vote less than ``fraction ×`` the round's median agreement. An attacker who
knows it sends its honest gradient with only a share ``p`` of its non-zero values negated:
its *largest* ones (by decoded magnitude, the tensor's or bucket's scale; ties in a seeded
order), where a negated value costs the most, keeping the small ones, which buy agreement;
every scale (dense value) is multiplied by ``F`` as ``near-bound:F`` does (the server's
scale bound and cap clip what is over them). :data:`ADAPTIVE_SHARE` is the share it uses.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from fedddl.attacks.recode import Recode, code_values
from fedddl.compression import decode_update, encode_update, read_header
from fedddl.compression.backends.buckets import bucket_scales

__all__ = ["ADAPTIVE_SHARE", "adaptive_payload"]

#: The share of its non-zero values ``adaptive:F`` negates: with the default direction check
#: (fraction 0.1) on digits its agreement stays 2-7 × the threshold and is hardly ever dropped;
#: a larger share is dropped more often, a smaller one opposes less.
ADAPTIVE_SHARE = 0.25
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def adaptive_payload(payload: bytes, factor: float, share: float) -> bytes:
    """``payload`` with its ``share`` largest non-zero values negated and every scale (dense
    value) ``× factor``, re-encoded with the same codecs and buckets.

    Parameters
    ----------
    payload : bytes
        The honest reply's encoded gradient.
    factor : float
        Multiplies every ternary (bucket) scale and dense value (capped at float32's largest).
    share : float
        The share, in ``[0, 1]``, of non-zero values (all tensors together) that are negated.
    """
    if not 0 <= share <= 1:
        raise ValueError(f"share must be in [0, 1], got {share}")
    entries = read_header(payload)
    decoded = decode_update(payload)
    flats = [decoded[e.name].reshape(-1).to(torch.float32) for e in entries]
    values = torch.cat(flats) if flats else torch.zeros(0)
    negated = round(share * int(torch.count_nonzero(values)))
    generator = torch.Generator().manual_seed(zlib.crc32(payload))
    shuffled = torch.randperm(values.numel(), generator=generator)
    order = shuffled[torch.argsort(values.abs()[shuffled], descending=True, stable=True)]
    flip = torch.ones_like(values)
    flip[order[:negated]] = -1.0
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    codecs: dict[str, tuple[str, int, torch.Tensor | None]] = {}
    start = 0
    for entry, flat in zip(entries, flats, strict=True):
        signs = flip[start : start + flat.numel()]
        start += flat.numel()
        shape = decoded[entry.name].shape
        if entry.codec is None:
            wide = (flat * signs).to(torch.float64) * factor
            dense = wide.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(decoded[entry.name].dtype)
            tensors[entry.name] = dense.reshape(shape)
            continue
        per_bucket = None
        scale = min(entry.scale * factor, _FLOAT32_MAX)
        if entry.bucket:
            honest = bucket_scales(flat, entry.bucket, None).to(torch.float64) * factor
            per_bucket = honest.clamp(max=_FLOAT32_MAX).to(torch.float32)
            scale = float(per_bucket.max()) if per_bucket.numel() else 0.0
        codes = code_values(flat, entry.scale, entry.codec)
        tensors[entry.name] = (codes * signs).reshape(shape)
        scales[entry.name] = float(np.float32(scale))
        codecs[entry.name] = (entry.codec, entry.bucket, per_bucket)
    return encode_update(tensors, Recode(codecs), scales=scales)
