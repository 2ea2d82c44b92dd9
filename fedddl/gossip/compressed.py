"""Compressed gossip: CHOCO-SGD edge updates with compressed differences of public copies.

For every ordered pair ``i -> j`` both ends keep the same public copy ``x̂_ij`` of
``x_i`` (starting at the shared initial model). ``i`` ships ``Q(x_i - x̂_ij)`` with a
:class:`LinkHeader` (``base``, ``seq``, per-tensor ``gains``, ``key``); both ends add
``gain * decoded`` to the copy, then take one consensus step on public copies only
(receiver on arrival: ``x_j += step * (x̂_ij - x̂_ji)``; sender on its ack: the
opposite), which keeps the nodes' average model.

:class:`CompressedGossip` holds one node's copies and returns the corrections to add
to its model; the simulator and the real peers both use it. A receiver applies a
difference only when ``base`` and ``seq`` match its copy, else it raises
:class:`LinkError` (:data:`LINK_OUT_OF_SYNC`) and the sender :meth:`~CompressedGossip.reset`-s
the link (next message: a key frame, the whole model). A sender commits an update only
once acknowledged. Only floating-point tensors travel; every copy a receiver builds is
checked finite and within ``max_abs_weight``. The rules and the variants measured and
dropped: docs/gossip.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedddl.compression import (
    IdentityCompressor,
    PayloadError,
    decode_update,
    encode_update,
    limits_for,
    make_compressor,
)
from fedddl.training import tensors_fingerprint

__all__ = [
    "DEFAULT_CLIP_SIGMA",
    "LINK_NO_BASE",
    "LINK_OUT_OF_SYNC",
    "MAX_GAIN",
    "CompressedGossip",
    "LinkError",
    "LinkHeader",
    "OutgoingUpdate",
    "ReceiverCopies",
    "SenderCopies",
    "add_correction",
    "float_tensors",
    "state_fingerprint",
]

#: Clipping of ternary compressors for differences (TernGrad's 2.5 sigma). Error feedback
#: keeps what the clip cuts. Measured with the least-squares gains: sending a model that
#: stands still, the copy's distance to it falls geometrically at 2.5 sigma (1e-4 of the
#: first after 30 messages) but stalls at 1-2 sigma (2-5 % after 40), whose clip leaves a
#: few large entries that shrink slowly; in the 16-node digits simulation 1.0 and 2.5
#: both reached 0.90 after 10 s of virtual time.
DEFAULT_CLIP_SIGMA = 2.5
#: Largest gain a message may carry (the least-squares gain is clipped to it; docs/gossip.md).
MAX_GAIN = 2.0
#: Reason texts of a refused difference; the sender answers both with a key frame.
LINK_OUT_OF_SYNC = "public copy out of sync"
LINK_NO_BASE = "no public copy to apply the difference to"


class LinkError(ValueError):
    """A compressed message cannot be applied.

    Attributes
    ----------
    key : str
        Short reason category: ``"link-out-of-sync"`` (the sender should send a
        key frame), ``"malformed-update"``, ``"non-finite"`` or ``"weight-range"``.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class LinkHeader:
    """Where a compressed message sits in its link's history (module docstring)."""

    base: str
    seq: int
    key: bool
    gains: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.base or len(self.base) > 64:
            raise ValueError(f"link base must be 1-64 characters, got {self.base!r}")
        if self.seq < 0:
            raise ValueError(f"link seq must be >= 0, got {self.seq}")
        if self.key and (self.seq != 0 or self.gains):
            raise ValueError("a key frame starts a link: its seq must be 0, without gains")
        for gain in self.gains:
            if not 0.0 <= gain <= MAX_GAIN:  # also rejects NaN
                raise ValueError(f"link gains must be in [0, {MAX_GAIN}], got {gain!r}")

    @property
    def extra_bytes(self) -> int:
        """Bytes the header adds on a compact wire (4 per gain; the simulator counts them)."""
        return 4 * len(self.gains)


@dataclass(frozen=True)
class OutgoingUpdate:
    """A prepared message of the link to ``peer``; :meth:`SenderCopies.commit` it once acked."""

    peer: int
    header: LinkHeader
    payload: bytes
    copy_after: dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Link:
    base: str
    seq: int  # differences applied since base
    copy: dict[str, torch.Tensor]


def float_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point tensors of ``state`` (what compressed gossip exchanges), detached."""
    return {k: v.detach() for k, v in state.items() if v.is_floating_point()}


def state_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """Short SHA-256 of names, shapes, dtypes and values (identifies a starting model)."""
    return "init-" + tensors_fingerprint(state)[:16]


class SenderCopies:
    """The sending side: one public copy per receiver, compressed differences against it.

    Parameters
    ----------
    compressor : str
        Registered compressor name (e.g. ``"ternary-base3"``).
    initial : Mapping[str, torch.Tensor]
        The model every node started from (its floating-point tensors are used).
    seed : int
        Seed of the compressor's random stream (use one per node).
    clip_sigma : float
        Clipping of ternary compressors (ignored by others); see :data:`DEFAULT_CLIP_SIGMA`.

    Not thread-safe: use it from one sending thread.
    """

    def __init__(
        self,
        compressor: str,
        initial: Mapping[str, torch.Tensor],
        *,
        seed: int,
        clip_sigma: float = DEFAULT_CLIP_SIGMA,
        scale_bucket: int = 0,
    ) -> None:
        self.compressor_name = compressor
        self._compressor = make_compressor(
            compressor, seed=seed, clip_sigma=clip_sigma, scale_bucket=scale_bucket
        )
        self._initial = {k: v.clone() for k, v in float_tensors(initial).items()}
        if not self._initial:
            raise ValueError("compressed gossip needs a model with floating-point tensors")
        self._initial_id = state_fingerprint(self._initial)
        self._links: dict[int, _Link] = {}
        self._needs_key: set[int] = set()
        self._keys_sent = 0
        self.key_frames = 0  # key frames prepared (diagnostics)
        self.last_bytes = self._delta_size()

    @property
    def initial_id(self) -> str:
        """The base id of links that start from the initial model."""
        return self._initial_id

    def expected_bytes(self) -> int:
        """Size of the next message: the last compressed message's size (scheduler input)."""
        return self.last_bytes

    def prepare(self, peer: int, model: Mapping[str, torch.Tensor]) -> OutgoingUpdate:
        """Encode the message for ``peer`` from ``model``; nothing changes until :meth:`commit`.

        Raises
        ------
        ValueError
            If ``model`` does not have the initial model's floating-point tensors, or has
            non-finite values.
        """
        current = float_tensors(model)
        if set(current) != set(self._initial):
            raise ValueError(
                f"model tensors differ from the initial model: "
                f"{sorted(set(current) ^ set(self._initial))}"
            )
        link = self._links.get(peer) or _Link(self._initial_id, 0, self._initial)
        if peer in self._needs_key:
            self._keys_sent += 1
            header = LinkHeader(f"key-{self._keys_sent}", 0, True)
            payload = encode_update(current, IdentityCompressor())
            copy_after = decode_update(payload, **limits_for(current))
            self.key_frames += 1
        else:
            difference = {k: current[k] - link.copy[k] for k in current}
            payload = encode_update(difference, self._compressor)
            decoded = decode_update(payload, **limits_for(current))
            gains = tuple(_gain(difference[k], decoded[k]) for k in decoded)
            header = LinkHeader(link.base, link.seq, False, gains)
            copy_after = _advance(link.copy, decoded, gains)
            self.last_bytes = len(payload) + header.extra_bytes
        return OutgoingUpdate(peer, header, payload, copy_after)

    def copy_at(self, peer: int) -> dict[str, torch.Tensor]:
        """The public copy of this node that ``peer`` holds (``x_0`` before the first message)."""
        link = self._links.get(peer)
        return self._initial if link is None else link.copy

    def commit(self, update: OutgoingUpdate) -> None:
        """The receiver acknowledged ``update``: advance the link's public copy."""
        seq = 1 if update.header.key else update.header.seq + 1
        self._links[update.peer] = _Link(update.header.base, seq, update.copy_after)
        self._needs_key.discard(update.peer)

    def reset(self, peer: int) -> None:
        """The link to ``peer`` is out of sync: its next message is a key frame."""
        self._needs_key.add(peer)

    def _delta_size(self) -> int:
        zeros = {k: torch.zeros_like(v) for k, v in self._initial.items()}
        probe = make_compressor(self.compressor_name, seed=0, clip_sigma=DEFAULT_CLIP_SIGMA)
        return len(encode_update(zeros, probe)) + 4 * len(zeros)


class ReceiverCopies:
    """The receiving side: one public copy per sender, advanced by each message.

    Parameters
    ----------
    initial : Mapping[str, torch.Tensor]
        This node's initial model: links whose base is its fingerprint start from it.
    max_abs_weight : float
        Largest absolute weight a copy may hold; a message that would exceed it
        is refused and the copy is left as it was.

    Not thread-safe: serialise calls (the peer holds a lock).
    """

    def __init__(
        self, initial: Mapping[str, torch.Tensor], *, max_abs_weight: float = math.inf
    ) -> None:
        if not max_abs_weight > 0:
            raise ValueError(f"max_abs_weight must be > 0, got {max_abs_weight}")
        self._initial = {k: v.clone() for k, v in float_tensors(initial).items()}
        self._initial_id = state_fingerprint(self._initial)
        self.max_abs_weight = float(max_abs_weight)
        self._links: dict[int, _Link] = {}

    def apply(self, sender: int, header: LinkHeader, payload: bytes) -> dict[str, torch.Tensor]:
        """Apply one message of ``sender``; return its public copy (new tensors).

        Raises
        ------
        LinkError
            If the link is out of sync or has no base (``key="link-out-of-sync"``),
            the payload is malformed or does not fit the model, or the copy would
            hold non-finite or out-of-range weights. The copy is then unchanged.
        """
        link = self._links.get(sender)
        if not header.key:
            if link is None or link.base != header.base:
                if header.base != self._initial_id or header.seq != 0:
                    raise LinkError(
                        "link-out-of-sync",
                        f"{LINK_NO_BASE} (base {header.base!r}): send a key frame",
                    )
                link = _Link(self._initial_id, 0, self._initial)
            if header.seq != link.seq:
                raise LinkError(
                    "link-out-of-sync",
                    f"{LINK_OUT_OF_SYNC}: difference {header.seq} of {header.base!r} "
                    f"but {link.seq} applied",
                )
        scratch = {k: torch.empty_like(v) for k, v in self._initial.items()}
        try:
            decoded = decode_update(payload, out=scratch)
        except PayloadError as exc:
            raise LinkError("malformed-update", f"compressed update: {exc}") from None
        for name, tensor in decoded.items():
            if not bool(torch.isfinite(tensor).all()):
                raise LinkError("non-finite", f"tensor {name!r} has non-finite values")
        if header.key:
            copy = decoded
        else:
            assert link is not None
            if len(header.gains) != len(decoded):
                raise LinkError(
                    "malformed-update",
                    f"{len(header.gains)} gains for {len(decoded)} tensors",
                )
            copy = _advance(link.copy, decoded, header.gains)
        for name, tensor in copy.items():
            if not bool(torch.isfinite(tensor).all()):
                raise LinkError("non-finite", f"tensor {name!r} would have non-finite values")
            largest = float(tensor.abs().max()) if tensor.numel() else 0.0
            if largest > self.max_abs_weight:
                raise LinkError(
                    "weight-range",
                    f"tensor {name!r} would hold |w| = {largest:.3g} > {self.max_abs_weight:g}",
                )
        self._links[sender] = _Link(header.base, 1 if header.key else header.seq + 1, copy)
        return {k: v.clone() for k, v in copy.items()}

    def links(self) -> int:
        """Number of senders this node holds a public copy of."""
        return len(self._links)

    def copy_of(self, sender: int) -> dict[str, torch.Tensor]:
        """This node's public copy of ``sender`` (``x_0`` before its first message)."""
        link = self._links.get(sender)
        return self._initial if link is None else link.copy

    def forget(self, sender: int) -> None:
        """Drop the copy of ``sender`` (its next difference needs a key frame)."""
        self._links.pop(sender, None)


class CompressedGossip:
    """One node's compressed gossip: its public copies as sender and as receiver.

    Parameters
    ----------
    compressor : str
        Registered compressor for the differences (e.g. ``"ternary-base3"``).
    initial : Mapping[str, torch.Tensor]
        The model the node started from (every node of a run starts from the same).
    seed : int
        Seed of the compressor's random stream (one per node).
    consensus_step : float
        Step of the edge updates (module docstring), in ``(0, 1]``.
    max_abs_weight : float
        Largest absolute weight a received copy may hold.
    clip_sigma : float
        Clipping of ternary compressors.
    scale_bucket : int
        Scale buckets of ternary compressors (0: one scale per tensor; see
        :class:`~fedddl.compression.TernaryCompressor`).

    Not thread-safe: the caller serialises all calls (the peer holds a lock).
    """

    def __init__(
        self,
        compressor: str,
        initial: Mapping[str, torch.Tensor],
        *,
        seed: int,
        consensus_step: float = 0.25,
        max_abs_weight: float = math.inf,
        clip_sigma: float = DEFAULT_CLIP_SIGMA,
        scale_bucket: int = 0,
    ) -> None:
        if not 0.0 < consensus_step <= 1.0:
            raise ValueError(f"consensus_step must be in (0, 1], got {consensus_step}")
        self.consensus_step = float(consensus_step)
        self.sender = SenderCopies(
            compressor, initial, seed=seed, clip_sigma=clip_sigma, scale_bucket=scale_bucket
        )
        self.receiver = ReceiverCopies(initial, max_abs_weight=max_abs_weight)

    def expected_bytes(self) -> int:
        """Size of the next message (what the scheduler plans with)."""
        return self.sender.expected_bytes()

    def prepare(self, peer: int, model: Mapping[str, torch.Tensor]) -> OutgoingUpdate:
        """Encode the message to ``peer`` (see :meth:`SenderCopies.prepare`)."""
        return self.sender.prepare(peer, model)

    def commit(self, update: OutgoingUpdate) -> dict[str, torch.Tensor]:
        """``update`` was acknowledged: advance the copy; return the sender's correction.

        Returns
        -------
        dict
            ``step * (x̂_ji - x̂_ij)``, to add to the sender's model.
        """
        self.sender.commit(update)
        return self.sender_correction(update.peer)

    def sender_correction(self, peer: int) -> dict[str, torch.Tensor]:
        """``step * (x̂_ji - x̂_ij)`` for the link to ``peer`` with the copies as they are now."""
        return self._correction(self.receiver.copy_of(peer), self.sender.copy_at(peer))

    def reset(self, peer: int) -> None:
        """The link to ``peer`` is out of sync: send it a key frame next."""
        self.sender.reset(peer)

    def receive(self, sender: int, header: LinkHeader, payload: bytes) -> dict[str, torch.Tensor]:
        """Apply a message of ``sender``; return the receiver's correction ``step * (x̂_ij - x̂_ji)``.

        Raises :class:`LinkError` (see :meth:`ReceiverCopies.apply`) with nothing changed.
        """
        copy = self.receiver.apply(sender, header, payload)
        return self._correction(copy, self.sender.copy_at(sender))

    def _correction(
        self, towards: Mapping[str, torch.Tensor], away: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {k: (towards[k] - away[k]) * self.consensus_step for k in towards}


def add_correction(
    state: Mapping[str, torch.Tensor], correction: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state + correction`` for the corrected tensors; others (non-float) unchanged."""
    return {k: (v + correction[k]) if k in correction else v for k, v in state.items()}


def _gain(difference: torch.Tensor, decoded: torch.Tensor) -> float:
    """Least-squares factor of ``decoded`` towards ``difference``, in ``[0, MAX_GAIN]`` (fp32)."""
    norm = float(torch.dot(decoded.reshape(-1).double(), decoded.reshape(-1).double()))
    if norm <= 0.0:
        return 0.0
    dot = float(torch.dot(difference.reshape(-1).double(), decoded.reshape(-1).double()))
    return float(np.float32(min(max(dot / norm, 0.0), MAX_GAIN)))


def _advance(
    copy: Mapping[str, torch.Tensor],
    decoded: Mapping[str, torch.Tensor],
    gains: tuple[float, ...],
) -> dict[str, torch.Tensor]:
    """``copy + gain * decoded`` per tensor; gains in ``decoded``'s (message) order.

    Sender and receiver both compute exactly this, so their copies stay bit-identical.
    """
    factors = dict(zip(decoded, gains, strict=True))
    return {k: copy[k] + decoded[k] * factors[k] for k in copy}
