"""An encoder for attacks: given codes at given scales, in a valid message.

:class:`Recode` is the :class:`~fedddl.compression.Compressor` the payload attacks
(:mod:`fedddl.attacks.tamper`, :mod:`fedddl.attacks.adaptive`) re-encode with, so a forged
message has a valid header, valid codes and a correct CRC; only its values lie.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedddl.compression import (
    Compressor,
    Context,
    DensePayload,
    Payload,
    TernaryPayload,
    pack_codes,
)
from fedddl.compression.backends.base5 import pack_base5
from fedddl.compression.backends.packing import CODE_MINUS, CODE_PLUS, CODE_ZERO

__all__ = ["Recode", "code_values"]


def code_values(decoded: torch.Tensor, scale: float, codec: str) -> torch.Tensor:
    """The codes of a decoded entry as numbers: its signs (ternary codecs), or its levels
    ``-2..2`` (``"base5"``: the decoded value over ``scale``)."""
    if codec != "base5":
        return torch.sign(decoded)
    if scale == 0.0:
        return torch.zeros_like(decoded)
    return torch.round(decoded.to(torch.float64) / scale).clamp(-2, 2).to(decoded.dtype)


class Recode(Compressor):
    """Encodes given codes (the signs of the input; for ``"base5"`` its levels, rounded and
    clipped to ``-2..2``) at given scales; dense without a scale.

    Parameters
    ----------
    codecs : Mapping[str, tuple[str, int, torch.Tensor | None]]
        The codec, bucket size and bucket scales (0 and None: one scale) of each ternary
        tensor, consumed in encoding order.
    """

    name = "attack-recode"

    def __init__(self, codecs: Mapping[str, tuple[str, int, torch.Tensor | None]]) -> None:
        self._codecs = iter(list(codecs.values()))

    def compress(
        self, tensor: torch.Tensor, *, scale: float | None = None
    ) -> tuple[Payload, Context]:
        ctx = Context(tuple(tensor.shape), tensor.dtype)
        if scale is None:
            return DensePayload(tensor.detach().contiguous().clone()), ctx
        flat = tensor.detach().reshape(-1)
        codec, bucket, per_bucket = next(self._codecs)
        if codec == "base5":
            levels = code_values(flat, 1.0, codec).to(torch.int8).numpy()
            packed5 = torch.from_numpy(pack_base5(levels))
            return TernaryPayload(packed5, scale, flat.numel(), codec), ctx
        codes = torch.full(flat.shape, CODE_ZERO, dtype=torch.uint8)
        codes[flat > 0] = CODE_PLUS
        codes[flat < 0] = CODE_MINUS
        packed = pack_codes(codes, codec)
        return TernaryPayload(packed, scale, flat.numel(), codec, bucket, per_bucket), ctx

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        raise NotImplementedError("the attack encoder never decompresses")
