"""A replica whose trainable parameters live on the integer grid (the ``grid`` downlink).

A :class:`GridReplica` is a model whose trainable parameters are the values of a
:class:`~fedddl.sync.grid.GridState` (there is no client-side optimiser: the server applies
momentum and sends integer counts), its other buffers (BatchNorm statistics) as the server
sent them, and a version. Two messages bring it forward, both decoded all or nothing
against the layout the model gives (bounded sizes):

* a catch-up (``FDGU``): ``b"FDGU"``, the model's buffers as raw bytes in
  ``named_buffers`` order, then a count-delta message
  (:func:`~fedddl.compression.codecs.counts.encode_counts`) from the replica's version;
* a grid snapshot (``FDGS``): ``b"FDGS"``, the fp32 anchors of the trainable parameters,
  the buffers, then the counts as one segment from zero
  (:meth:`~fedddl.sync.grid.GridState.snapshot_segment`).

Both encode exactly the state, so :meth:`GridReplica.fingerprint` equals the server's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedddl.compression import PayloadError
from fedddl.compression.codecs.count_delta import CountDelta
from fedddl.compression.codecs.counts import decode_counts, encode_counts
from fedddl.running_stats import batchnorm_layers
from fedddl.sync.grid import GridError, GridState

__all__ = ["CATCH_UP_MAGIC", "SNAPSHOT_MAGIC", "GridReplica"]

CATCH_UP_MAGIC = b"FDGU"
SNAPSHOT_MAGIC = b"FDGS"
#: Segments a catch-up may carry (one per rebase in the stretch, plus one).
_MAX_SEGMENTS = 64


def _raw(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for t in tensors)  # fmt: skip


def _tensors_of(
    data: bytes, like: list[tuple[str, torch.Tensor]], what: str
) -> dict[str, torch.Tensor]:
    """Tensors shaped and typed as ``like`` from raw bytes (``len(data)`` must fit exactly)."""
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, t in like:
        size = t.numel() * t.element_size()
        chunk = bytearray(data[at : at + size])
        at += size
        if len(chunk) != size:
            raise GridError(f"{what}: truncated at {name!r}")
        value = (
            torch.frombuffer(chunk, dtype=t.dtype).reshape(t.shape)
            if size
            else t.new_empty(t.shape)
        )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise GridError(f"{what}: {name!r} is not finite")
        out[name] = value.clone()
    if at != len(data):
        raise GridError(f"{what}: {len(data) - at} bytes too many")
    return out


class GridReplica:
    """A model on the grid and its version (see the module docstring).

    Parameters
    ----------
    model : torch.nn.Module
        The seeded initial model (version 0); owned by the replica.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.version = 0
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._buffers = list(model.named_buffers())
        self.grid = GridState({n: p for n, p in self._params})
        #: The model's BatchNorm layers that track running statistics.
        self.batchnorm = batchnorm_layers(model)

    # ----------------------------------------------------------------- the state
    @property
    def layout(self) -> dict[str, tuple[int, ...]]:
        """The trainable parameters' names and shapes, in order."""
        return self.grid.layout

    def max_bytes(self) -> int:
        """The most bytes a count-delta message for this model may take."""
        numel = sum(math.prod(shape) for shape in self.layout.values())
        return _MAX_SEGMENTS * (5 * numel + 3 * len(self.layout) + 1) + 4096

    def fingerprint(self) -> str:
        """The sha256 fingerprint of parameters and buffers (as ``Replica.fingerprint``)."""
        from fedddl.training import parameters_fingerprint

        return parameters_fingerprint(self.model)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers (live tensors)."""
        return dict(self._buffers)

    def _write(self, grid: GridState, buffers: dict[str, torch.Tensor] | None) -> None:
        values = grid.values()
        with torch.no_grad():
            for name, param in self._params:
                param.copy_(values[name])
            for name, buffer in self._buffers:
                if buffers is not None:
                    buffer.copy_(buffers[name])
        self.grid = grid

    def set_grid(self, grid: GridState, version: int) -> None:
        """Adopt ``grid`` (the server's state after an update) at ``version``."""
        self._write(grid, None)
        self.version = version

    # ------------------------------------------------------------------ messages
    def catch_up_message(self, delta: CountDelta) -> bytes:
        """The ``FDGU`` message of ``delta``, with this replica's current buffers."""
        return (
            CATCH_UP_MAGIC + _raw([b for _, b in self._buffers]) + encode_counts(delta, self.layout)
        )

    def _buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for _, b in self._buffers)

    def decode_catch_up(self, data: bytes) -> tuple[CountDelta, dict[str, torch.Tensor]]:
        """The count delta and buffers of an ``FDGU`` message.

        Raises
        ------
        GridError
            A message that does not decode for this model (names the problem).
        """
        if bytes(data[:4]) != CATCH_UP_MAGIC:
            raise GridError(f"grid catch-up: bad magic {bytes(data[:4])!r}")
        end = 4 + self._buffer_bytes()
        buffers = _tensors_of(bytes(data[4:end]), self._buffers, "grid catch-up buffers")
        try:
            delta = decode_counts(bytes(data[end:]), self.layout, self.max_bytes())
        except PayloadError as err:
            raise GridError(f"grid catch-up: {err}") from err
        return delta, buffers

    def apply_catch_up(self, data: bytes) -> bool:
        """Apply an ``FDGU`` message, all or nothing; False (nothing changed) when it does not
        start at this replica's version.

        Raises
        ------
        GridError
            A message that does not decode or apply (the replica is unchanged).
        """
        delta, buffers = self.decode_catch_up(data)
        if delta.from_version != self.version:
            return False
        trial = self.grid.copy()
        trial.apply_catch_up(delta)
        self._write(trial, buffers)
        self.version = delta.to_version
        return True

    def snapshot_bytes(self) -> bytes:
        """The ``FDGS`` snapshot of this replica."""
        grid = self.grid
        delta = CountDelta(self.version, self.version, (grid.snapshot_segment(),))
        anchors = _raw(list(grid.anchors().values()))
        buffers = _raw([b for _, b in self._buffers])
        return SNAPSHOT_MAGIC + anchors + buffers + encode_counts(delta, self.layout)

    def load_snapshot_bytes(self, data: bytes) -> None:
        """Become the replica an ``FDGS`` snapshot describes, all or nothing.

        Raises
        ------
        GridError
            A snapshot that does not decode for this model (the replica is unchanged).
        """
        if bytes(data[:4]) != SNAPSHOT_MAGIC:
            raise GridError(f"grid snapshot: bad magic {bytes(data[:4])!r}")
        like = [(n, p.detach()) for n, p in self._params]
        anchor_end = 4 + sum(p.numel() * 4 for _, p in like)
        anchors = _tensors_of(bytes(data[4:anchor_end]), like, "grid snapshot anchors")
        end = anchor_end + self._buffer_bytes()
        buffers = _tensors_of(bytes(data[anchor_end:end]), self._buffers, "grid snapshot buffers")
        try:
            delta = decode_counts(bytes(data[end:]), self.layout, self.max_bytes())
        except PayloadError as err:
            raise GridError(f"grid snapshot: {err}") from err
        if len(delta.segments) != 1 or delta.segments[0].rebase:
            raise GridError("grid snapshot: the counts must be one segment without a rebase")
        grid = GridState.from_snapshot(anchors, delta.segments[0])
        self._write(grid, buffers)
        self.version = delta.to_version
