"""What one peer may do to a node, even an authenticated one, and the record of refusals.

* :class:`AdmissionLimits` -- the bounds a node enforces on every peer:

  ``max_model_rate`` / ``model_burst``
      Model frames (MODEL and DELTA) per second and burst, per sender
      (:class:`TokenBucket`); the excess is answered ``RESOURCE_EXHAUSTED``.
      Honest senders pace themselves to the same rate, so they are never refused
      when all nodes use the same settings.
  ``max_version_jump``
      A frame's model version (its Lamport clock) may exceed the highest clock
      the node has seen -- its own and every version it accepted -- by at most
      this many steps; otherwise one frame could drag every clock up to any
      value (and, with ``--merge version``, claim nearly all the merge weight).
      An honest peer is ahead by at most its own steps since it was last heard
      of (its state reaches every peer at least once a second), so the bound
      must exceed a fast peer's steps per second.
  ``max_abs_weight``
      Every weight of a received model (or of a compressed link's public copy)
      must be finite and at most this in absolute value.

* :class:`Admission` -- applies those limits to one node's incoming frames;
  each check raises :class:`RejectedFrame` (a gRPC status, a reason text and a
  reason category) and changes nothing.

* :class:`RejectionLog` -- counts every refused frame by peer and reason, and
  logs the first refusal of each (peer, reason) pair only, so a flood of bad
  frames costs one log line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
import torch

__all__ = ["Admission", "AdmissionLimits", "RejectedFrame", "RejectionLog", "TokenBucket"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on each peer's influence (see the module docstring)."""

    max_model_rate: float = 50.0
    model_burst: int = 10
    max_version_jump: int = 1000
    max_abs_weight: float = 1000.0

    def __post_init__(self) -> None:
        checks = {
            "max_model_rate": self.max_model_rate > 0,
            "model_burst": self.model_burst >= 1,
            "max_version_jump": self.max_version_jump >= 0,
            "max_abs_weight": self.max_abs_weight > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"AdmissionLimits.{name} is out of range: {getattr(self, name)!r}")


class RejectedFrame(Exception):
    """Raised by a frame handler to refuse a frame with a status and a reason.

    Parameters
    ----------
    code : grpc.StatusCode
        Status returned to the sender.
    reason : str
        Human-readable reason, returned to the sender and logged.
    key : str
        Short reason category for the counters (e.g. ``"rate-limit"``).
    peer : int, optional
        The node the frame is from, when known (for the counters).
    """

    def __init__(
        self, code: grpc.StatusCode, reason: str, key: str = "refused", peer: int | None = None
    ) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.key = key
        self.peer = peer


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; one token per admitted frame.

    Parameters
    ----------
    rate : float
        Tokens added per second.
    burst : int
        Capacity (and the initial fill).
    clock : Callable[[], float]
        Injected for tests; ``time.monotonic`` by default.
    """

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not rate > 0 or burst < 1:
            raise ValueError(f"need rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def take(self) -> bool:
        """Take one token if there is one; ``False`` means over the rate."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class RejectionLog:
    """Counts refused frames per (peer, reason); logs each pair's first refusal only.

    Parameters
    ----------
    owner : str
        Prefix of the log lines (e.g. ``"node 3"``).
    action : str
        What was done to the frames, in the log lines (``"rejected"``; a node's clip
        log says ``"clipped"``).
    """

    def __init__(self, owner: str, action: str = "rejected") -> None:
        self.owner = owner
        self.action = action
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}
        self._by_status: dict[str, int] = {}

    def record(
        self, peer: str, reason: str, status: str, detail: str, level: int | None = None
    ) -> None:
        """Count one frame from ``peer`` for ``reason`` (answered ``status``).

        The first of each (peer, reason) pair is logged at ``level``; by default
        INFO for ``UNAVAILABLE`` and WARNING otherwise.
        """
        with self._lock:
            reasons = self._counts.setdefault(peer, {})
            first = reason not in reasons
            reasons[reason] = reasons.get(reason, 0) + 1
            self._by_status[status] = self._by_status.get(status, 0) + 1
        if first:
            # UNAVAILABLE ("finished", "not ready") is a normal answer, not a sign of a bad peer.
            if level is None:
                level = logging.INFO if status == "UNAVAILABLE" else logging.WARNING
            _log.log(
                level,
                "%s: %s frame from %s: %s (%s; further %r frames of this peer are "
                "only counted)",
                self.owner, self.action, peer, detail, status, reason,
            )

    def by_peer(self) -> dict[str, dict[str, int]]:
        """``{peer: {reason: count}}``, a copy."""
        with self._lock:
            return {peer: dict(reasons) for peer, reasons in self._counts.items()}

    def by_status(self) -> dict[str, int]:
        """``{gRPC status name: count}``, a copy."""
        with self._lock:
            return dict(self._by_status)


class Admission:
    """The limits of one node, applied frame by frame (thread-safe).

    Parameters
    ----------
    limits : AdmissionLimits
        The bounds.
    clock : Callable[[], float]
        Injected for tests; ``time.monotonic`` by default.
    """

    def __init__(
        self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[int, TokenBucket] = {}
        self._max_seen = 0

    def take_model_slot(self, sender: int) -> None:
        """Count one model frame of ``sender`` against its rate.

        Raises
        ------
        RejectedFrame
            ``RESOURCE_EXHAUSTED`` over the rate.
        """
        with self._lock:
            bucket = self._buckets.get(sender)
            if bucket is None:
                limits = self.limits
                bucket = TokenBucket(limits.max_model_rate, limits.model_burst, self._clock)
                self._buckets[sender] = bucket
            admitted = bucket.take()
        if not admitted:
            raise RejectedFrame(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"over the rate limit of {self.limits.max_model_rate:g} model frames/s "
                f"(burst {self.limits.model_burst})",
                "rate-limit",
                sender,
            )

    def check_version(self, sender: int, version: int, own_version: int) -> None:
        """Refuse a clock that jumps past ``max(own, highest seen) + max_version_jump``.

        Raises
        ------
        RejectedFrame
            ``INVALID_ARGUMENT``.
        """
        with self._lock:
            reference = max(own_version, self._max_seen)
        bound = reference + self.limits.max_version_jump
        if version > bound:
            raise RejectedFrame(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model version {version} jumps past {bound} (highest clock seen {reference} "
                f"+ {self.limits.max_version_jump})",
                "version-jump",
                sender,
            )

    def accept_version(self, version: int) -> None:
        """Remember an accepted clock (it raises the reference of later checks)."""
        with self._lock:
            self._max_seen = max(self._max_seen, version)

    @property
    def highest_version(self) -> int:
        """The highest clock accepted so far."""
        with self._lock:
            return self._max_seen

    def check_weights(self, sender: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse non-finite weights and weights beyond ``max_abs_weight``.

        Raises
        ------
        RejectedFrame
            ``INVALID_ARGUMENT``.
        """
        bound = self.limits.max_abs_weight
        for name, tensor in tensors.items():
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if not bool(torch.isfinite(tensor).all()):
                raise RejectedFrame(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor {name!r} has non-finite values",
                    "non-finite",
                    sender,
                )
            largest = float(tensor.abs().max())
            if largest > bound:
                raise RejectedFrame(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor {name!r} holds |w| = {largest:.3g} > {bound:g}",
                    "weight-range",
                    sender,
                )
