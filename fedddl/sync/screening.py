"""Expected shape first: a reply's payload header checked against the model before decoding.

:class:`PayloadSpec` is what every reply's encoded gradient must look like for this model
and uplink compressor: exactly one entry per trainable parameter (same names, same shapes),
each a floating dtype, each of a kind the compressor produces (a :class:`TernaryCompressor`
sends its own codec only, dense entries only for tensors below its ``min_numel``; the
identity compressor sends dense entries only; a plug-in compressor may send either), and at
most :attr:`PayloadSpec.max_bytes` bytes in all; the fp32-exempt parameters
(:mod:`fedddl.sync.exemptions`) are always dense.

:meth:`PayloadSpec.check` reads the header with
:func:`fedddl.compression.codecs.wire.open_message` (the checks of
:func:`~fedddl.compression.codecs.wire.read_header`), which rejects a message over ``max_bytes`` or
declaring more tensors than the model has *before* parsing its entries, so the work one
reply can cause is proportional to the model, not to what the client declares (a message of
65,536 one-element tensors is rejected from its 18-byte prefix). No ternary value is decoded
here; the values of the dense entries (the small fp32-exempt tensors) are read to measure
their largest magnitude, which the scale bound (:mod:`fedddl.sync.scale_bound`) bounds like
a ternary scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fedddl.compression import (
    Compressor,
    EntryHeader,
    IdentityCompressor,
    OpenedMessage,
    PayloadError,
    QuinaryProjectedCompressor,
    TernaryCompressor,
    open_message,
)
from fedddl.compression.algorithms.ternary_buckets import bucket_of
from fedddl.sync.errors import PayloadRejected

__all__ = ["PayloadSpec"]

# Fixed bytes of a message (prefix + CRC) and the largest per-entry header besides the
# name and the dims: u16 name length, dtype, kind, ndim, f32 scale, u32 bucket size.
_MESSAGE_OVERHEAD = 18 + 4
_ENTRY_OVERHEAD = 2 + 3 + 4 + 4
_LARGEST_ITEMSIZE = 8  # float64, the widest dtype of the wire format


@dataclass(frozen=True)
class PayloadSpec:
    """What a reply's encoded gradient must look like (see the module docstring).

    Attributes
    ----------
    shapes : dict[str, tuple[int, ...]]
        Trainable parameter names and shapes, in the model's order.
    ternary_codecs : frozenset[str] | None
        Codecs a ternary entry may use (None: any; empty: ternary entries are refused).
    dense_below : int | None
        Dense entries are accepted only for tensors with fewer elements than this
        (None: for any tensor).
    max_bytes : int
        Largest acceptable message: every tensor dense in float64, plus its header.
    dense_names : frozenset[str]
        Tensors that are always sent dense (the fp32 exemptions).
    dtypes : dict[str, torch.dtype] | None
        The dtype each entry must have (None: any floating dtype).
    buckets : dict[str, int] | None
        The scale-bucket size each ternary entry must have (0: one scale; None: any).
    """

    shapes: dict[str, tuple[int, ...]]
    ternary_codecs: frozenset[str] | None
    dense_below: int | None
    max_bytes: int
    dense_names: frozenset[str] = frozenset()
    dtypes: dict[str, torch.dtype] | None = None
    buckets: dict[str, int] | None = None

    @classmethod
    def for_model(
        cls, model: nn.Module, compressor: Compressor, dense: frozenset[str] = frozenset()
    ) -> PayloadSpec:
        """The spec of ``model``'s gradients encoded with ``compressor``, the parameters in
        ``dense`` (TernGrad's fp32 exemptions, :mod:`fedddl.sync.exemptions`) sent dense."""
        shapes = {
            name: tuple(int(d) for d in p.shape)
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        return cls.for_shapes(shapes, compressor, dense)

    @classmethod
    def for_shapes(
        cls,
        shapes: dict[str, tuple[int, ...]],
        compressor: Compressor,
        dense: frozenset[str] = frozenset(),
        dtypes: dict[str, torch.dtype] | None = None,
    ) -> PayloadSpec:
        """The spec of the named tensors ``shapes`` (in order) encoded with ``compressor``,
        those in ``dense`` sent dense, each of its dtype in ``dtypes`` when given."""
        max_bytes = _MESSAGE_OVERHEAD + sum(
            _ENTRY_OVERHEAD
            + len(name.encode("utf-8"))
            + 8 * len(shape)
            + _LARGEST_ITEMSIZE * math.prod(shape)
            for name, shape in shapes.items()
        )
        codecs: frozenset[str] | None
        dense_below: int | None
        buckets: dict[str, int] | None = None
        if isinstance(compressor, TernaryCompressor):
            codecs, dense_below = frozenset({compressor.codec}), compressor.min_numel
            buckets = {n: bucket_of(s, compressor.scale_bucket) for n, s in shapes.items()}
        elif isinstance(compressor, QuinaryProjectedCompressor):
            codecs, dense_below = frozenset({"base5"}), compressor.min_numel
        elif isinstance(compressor, IdentityCompressor):
            codecs, dense_below = frozenset(), None
        else:  # a plug-in: its payload kinds are not known in advance
            codecs, dense_below = None, None
        return cls(
            shapes,
            codecs,
            dense_below,
            max_bytes,
            frozenset(dense) & set(shapes),
            dtypes,
            buckets,
        )

    def check(self, payload: bytes, node: int) -> OpenedMessage:
        """Read ``payload``'s header and check it against the spec; decode nothing.

        Returns
        -------
        OpenedMessage
            The message: its entries (in message order) and, for the accepted reply, its
            decoding without a second reading of the header.

        Raises
        ------
        PayloadRejected
            Naming the first difference (size, count, names, a shape, a kind).
        """
        what = f"node {node} payload rejected"
        try:
            message = open_message(
                payload,
                max_bytes=self.max_bytes,
                max_tensors=len(self.shapes),
                max_values=sum(math.prod(shape) for shape in self.shapes.values()),
                dense_peaks=True,
            )
        except PayloadError as err:
            raise PayloadRejected(f"{what}: {err}") from err
        entries = message.entries
        names = [entry.name for entry in entries]
        if sorted(names) != sorted(self.shapes):
            missing = sorted(set(self.shapes) - set(names))
            unexpected = sorted(set(names) - set(self.shapes))
            raise PayloadRejected(
                f"{what}: tensor names do not match the model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for entry in entries:
            want = self.shapes[entry.name]
            if entry.shape != want:
                raise PayloadRejected(
                    f"{what}: tensor {entry.name!r} has shape {entry.shape}, the model's is {want}"
                )
            if self.dtypes is not None and entry.dtype != self.dtypes[entry.name]:
                raise PayloadRejected(
                    f"{what}: tensor {entry.name!r} is {entry.dtype}, the model's is "
                    f"{self.dtypes[entry.name]}"
                )
            self._check_kind(entry, what)
        return message

    def _check_kind(self, entry: EntryHeader, what: str) -> None:
        if entry.name in self.dense_names:
            if entry.codec is not None:
                raise PayloadRejected(
                    f"{what}: tensor {entry.name!r} is ternary, it is sent in fp32 (exempt)"
                )
        elif entry.codec is None:
            if self.dense_below is not None and entry.numel >= self.dense_below:
                raise PayloadRejected(
                    f"{what}: tensor {entry.name!r} is dense, the compressor sends it ternary"
                )
        elif self.ternary_codecs is not None and entry.codec not in self.ternary_codecs:
            expected = sorted(self.ternary_codecs) or ["dense"]
            raise PayloadRejected(
                f"{what}: tensor {entry.name!r} uses codec {entry.codec!r}, expected "
                f"{' or '.join(expected)}"
            )
        elif self.buckets is not None and entry.bucket != self.buckets[entry.name]:
            raise PayloadRejected(
                f"{what}: tensor {entry.name!r} has scale buckets of {entry.bucket} values, "
                f"expected {self.buckets[entry.name]} (0: one scale)"
            )
