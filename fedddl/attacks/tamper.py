"""How an attacking client turns its honest reply into a malicious, well-formed one.

:func:`tamper_reply` takes the :class:`~fedddl.sync.messages.ClientReply` the honest worker
computed and returns the attacker's (kinds: :mod:`fedddl.attacks.spec`). Payload attacks
re-encode the honest gradient with :func:`fedddl.compression.encode_update`, so the message
has a valid header, valid codes and a correct CRC; only its values lie.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from functools import lru_cache

import numpy as np
import torch

from fedddl.attacks.recode import Recode, code_values
from fedddl.attacks.spec import Attack
from fedddl.compression import decode_update, encode_update, read_header
from fedddl.compression.backends.buckets import bucket_scales
from fedddl.compression.backends.packing import CODE_PLUS
from fedddl.compression.codecs.wire import FORMAT_VERSION, MAGIC
from fedddl.sync.messages import ClientReply

__all__ = [
    "MANY_TENSORS",
    "forged_statistics",
    "many_tensors_payload",
    "rewrite_payload",
    "tamper_reply",
]

#: Tensors in the ``many-tensors`` payload (the wire format's limit).
MANY_TENSORS = 1 << 16
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_PAYLOAD_KINDS = ("scale", "sign-flip", "all-plus", "near-bound")
_WIRE_PREFIX = struct.Struct("<4sBBIQ")
# dtype float32 (1), kind 2-bit (1), ndim 1, dim 1, scale 1.0
_ONE_ELEMENT_2BIT = struct.pack("<BBBQf", 1, 1, 1, 1, 1.0)


def tamper_reply(reply: ClientReply, attack: Attack) -> ClientReply:
    """The attacker's reply in place of the honest ``reply`` (a resync stays a resync,
    except for ``resync-spam``, which always is one)."""
    if attack.kind == "resync-spam":
        return ClientReply.resync_request(reply.node_id, -1)
    if reply.payload is None:
        return reply
    if attack.kind == "nan-metrics":
        return dataclasses.replace(reply, loss=math.nan)
    if attack.kind == "inf-metrics":
        return dataclasses.replace(reply, loss=math.inf)
    if attack.kind == "huge-examples":
        return dataclasses.replace(reply, num_examples=1 << 62)
    if attack.kind == "fingerprint-lie":
        lie = bytes(b ^ 0xFF for b in bytes.fromhex(reply.fingerprint)).hex()
        return dataclasses.replace(reply, fingerprint=lie)
    if attack.kind == "bn-statistics":
        if reply.statistics is None:
            return reply
        assert attack.arg is not None
        return dataclasses.replace(
            reply, statistics=forged_statistics(reply.statistics, attack.arg)
        )
    if attack.kind == "many-tensors":
        return dataclasses.replace(reply, payload=many_tensors_payload())
    if attack.kind == "adaptive":
        from fedddl.attacks.adaptive import ADAPTIVE_SHARE, adaptive_payload

        assert attack.arg is not None
        forged = adaptive_payload(reply.payload, attack.arg, ADAPTIVE_SHARE)
        return dataclasses.replace(reply, payload=forged)
    if attack.kind in _PAYLOAD_KINDS:
        scales = reply.scales
        if attack.kind == "scale" and scales is not None:  # the reported local scales too
            assert attack.arg is not None
            wide = scales.to(torch.float64) * attack.arg
            scales = wide.clamp(max=_FLOAT32_MAX).to(torch.float32)
        payload = rewrite_payload(reply.payload, attack)
        statistics = reply.statistics
        if attack.kind == "scale" and statistics is not None:
            assert attack.arg is not None
            statistics = _scaled_statistics(statistics, attack.arg)
        return dataclasses.replace(reply, payload=payload, scales=scales, statistics=statistics)
    raise ValueError(f"unknown attack kind {attack.kind!r}")


def rewrite_payload(payload: bytes, attack: Attack) -> bytes:
    """``payload`` with its values changed by a ``scale``, ``sign-flip``, ``all-plus`` or
    ``near-bound`` attack.

    Ternary entries keep their codec: ``scale:S`` multiplies the scale (capped at the
    largest finite float32), ``sign-flip`` negates the codes, ``all-plus`` sets every code
    to +1, ``near-bound:F`` negates the codes and multiplies the scale. Dense entries get
    the same treatment on their values. An entry with scale buckets keeps its buckets
    (each bucket's scale, read back as its largest decoded magnitude, gets the treatment).
    """
    entries = read_header(payload)
    decoded = decode_update(payload)
    values: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    codecs: dict[str, tuple[str, int, torch.Tensor | None]] = {}
    for entry in entries:
        tensor = decoded[entry.name]
        if entry.codec is None:
            values[entry.name] = _dense(tensor, attack)
            continue
        codes = code_values(tensor.to(torch.float32), entry.scale, entry.codec)
        scale = entry.scale
        per_bucket = None
        if entry.bucket:
            per_bucket = bucket_scales(tensor.reshape(-1).to(torch.float32), entry.bucket, None)
        if attack.kind in ("scale", "near-bound"):
            assert attack.arg is not None
            scale = min(scale * attack.arg, _FLOAT32_MAX)
            if per_bucket is not None:
                wide = per_bucket.to(torch.float64) * attack.arg
                per_bucket = wide.clamp(max=_FLOAT32_MAX).to(torch.float32)
        if attack.kind in ("sign-flip", "near-bound"):
            codes = -codes
        elif attack.kind == "all-plus":
            codes = torch.ones_like(codes)
        values[entry.name] = codes
        if per_bucket is not None:
            scale = float(per_bucket.max()) if per_bucket.numel() else 0.0
        scales[entry.name] = float(np.float32(scale))
        codecs[entry.name] = (entry.codec, entry.bucket, per_bucket)
    return encode_update(values, Recode(codecs), scales=scales)


def _scaled_statistics(statistics: bytes, factor: float) -> bytes:
    """BatchNorm statistics with means ``× factor`` and variances ``× factor²`` (capped)."""
    from fedddl.compression import IdentityCompressor

    stats = decode_update(statistics)
    for key, value in stats.items():
        part = key.rpartition(".")[2]
        power = {"mean": 1, "var": 2}.get(part)
        if power is not None:
            wide = value.to(torch.float64) * factor**power
            stats[key] = wide.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(value.dtype)
    return encode_update(stats, IdentityCompressor())


def forged_statistics(statistics: bytes, factor: float) -> bytes:
    """BatchNorm statistics forged by ``bn-statistics:F``: per layer, every mean set to
    ``factor ×`` the layer's largest ``|mean|``, every variance 0."""
    from fedddl.compression import IdentityCompressor

    stats = decode_update(statistics)
    for key, value in stats.items():
        part = key.rpartition(".")[2]
        if part == "mean":
            peak = float(value.abs().max()) if value.numel() else 0.0
            stats[key] = torch.full_like(value, min(factor * peak, _FLOAT32_MAX / 2))
        elif part == "var":
            stats[key] = torch.zeros_like(value)
    return encode_update(stats, IdentityCompressor())


def _dense(tensor: torch.Tensor, attack: Attack) -> torch.Tensor:
    if attack.kind in ("scale", "near-bound"):
        assert attack.arg is not None
        sign = -1.0 if attack.kind == "near-bound" else 1.0
        wide = tensor.to(torch.float64) * (sign * attack.arg)
        return wide.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(tensor.dtype)
    if attack.kind == "sign-flip":
        return -tensor
    peak = tensor.abs().max() if tensor.numel() else torch.tensor(0.0)
    return torch.full_like(tensor, float(peak))


@lru_cache(maxsize=1)
def many_tensors_payload() -> bytes:
    """A valid message of :data:`MANY_TENSORS` one-element ternary tensors (built once).

    Written byte by byte in the layout of :mod:`fedddl.compression.codecs.wire` (the same bytes
    :func:`encode_update` gives for ``{"t<i>": [1.0]}`` at scale 1, 2-bit codes, which
    takes a minute in Python for 65,536 tensors): entries ``"t<i>"``, float32, 2-bit, shape
    ``(1,)``, scale 1.0, each one data byte holding code +1.
    """
    entries = b"".join(
        struct.pack("<H", len(name)) + name + _ONE_ELEMENT_2BIT
        for name in (f"t{i}".encode() for i in range(MANY_TENSORS))
    )
    data = bytes([CODE_PLUS]) * MANY_TENSORS
    total = _WIRE_PREFIX.size + len(entries) + len(data) + 4
    prefix = _WIRE_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, MANY_TENSORS, total)
    body = prefix + entries + data
    return body + struct.pack("<I", zlib.crc32(body))
