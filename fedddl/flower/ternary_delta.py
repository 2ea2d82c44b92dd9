""":class:`TernaryDelta`: a Flower strategy wrapper that sends and receives ternary model deltas.

Wrap any Flower ``Strategy``; add :func:`fedddl.flower.ternary_mod` to the ClientApp;
nothing else changes::

    from flwr.serverapp.strategy import FedAvg
    from fedddl.flower import TernaryDelta

    strategy = TernaryDelta(FedAvg(fraction_train=0.5))
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

Downlink: the broadcast model moves towards each new global model by one ternary delta
(error feedback without a residual); a node holding a logged version gets only the
deltas it misses, any other node the whole model. Uplink: a reply's model delta is
added to the exact global model the wrapped strategy handed out. A compressed reply
that does not decode, fit, stay finite or answer a version sent becomes an error reply
naming the reason (never an exception), and that node gets the whole model next.
Replies and messages without the mod's records pass through unchanged. Details:
docs/drop-in-compression.md.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Iterable

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedddl.compression import PayloadError, decode_update, encode_update, limits_for
from fedddl.compression.algorithms.registry import make_compressor
from fedddl.flower.delta_protocol import (
    DELTA,
    DELTA_KEY,
    META,
    UPDATES,
    Broadcast,
    SplitModel,
    digest,
    join_model,
    max_payload_bytes,
    parse_reply_meta,
    same_layout,
    split_model,
    update_key,
)
from fedddl.flower.records import array_to_bytes, bytes_to_array
from fedddl.seeding import derive_seed

__all__ = ["TernaryDelta"]

_INFO, _WARNING = logging.INFO, logging.WARNING


class TernaryDelta(Strategy):
    """Ternary model deltas up and down around any Flower strategy.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy (FedAvg, FedProx, a DP wrapper, ...): it samples nodes,
        builds the messages and aggregates as usual.
    compressor : str
        Registered compressor, up and down; the default (deterministic threshold ternary,
        1.6 bits per value) is contractive, which error feedback needs (why not TernGrad's
        stochastic ternary: docs/drop-in-compression.md).
    clip_sigma : float
        Ternary clipping of each delta tensor, in standard deviations.
    error_feedback : bool
        Residual memory on each client for the uplink (what a delta could not carry is
        sent later); the downlink corrects its error by construction.
    downlink : bool
        Send deltas of the global model to nodes that hold the previous broadcast
        (``False``: every message carries the whole, exact global model).
    update_log_size : int
        Encoded downlink deltas kept for nodes that missed rounds.
    seed : int
        Seed of the compressors' stochastic rounding.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        compressor: str = "ternary-threshold-base3",
        clip_sigma: float = 2.5,
        error_feedback: bool = True,
        downlink: bool = True,
        update_log_size: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Flower Strategy, got {type(strategy).__name__}")
        if update_log_size < 0:
            raise ValueError(f"update_log_size must be >= 0, got {update_log_size}")
        if not clip_sigma > 0:
            raise ValueError(f"clip_sigma must be > 0, got {clip_sigma}")
        make_compressor(compressor, seed=0, clip_sigma=clip_sigma)  # unknown name: ValueError
        self.strategy = strategy
        self.compressor = compressor
        self.clip_sigma = float(clip_sigma)
        self.error_feedback = error_feedback
        self.downlink = downlink
        self.update_log_size = update_log_size
        self.seed = seed
        self.version = 0
        self.dropped: dict[str, int] = {}
        self._names: list[str] = []
        self._floats: dict[str, torch.Tensor] = {}
        self._exact: dict[str, torch.Tensor] = {}
        self._others: dict[str, Array] = {}
        self._digest = ""
        self._target_digest = ""
        self._log: deque[tuple[int, bytes]] = deque()
        self._held: dict[int, int] = {}
        self._plain: set[int] = set()
        self._sent: dict[int, tuple[int, Message]] = {}

    def __repr__(self) -> str:
        """Name and settings."""
        return (
            f"TernaryDelta({self.strategy!r}, compressor={self.compressor!r}, "
            f"downlink={self.downlink}, error_feedback={self.error_feedback})"
        )

    def summary(self) -> None:
        """Log the settings, then the wrapped strategy's summary."""
        log(_INFO, "\t├──> TernaryDelta settings:")
        log(_INFO, "\t│\t├── Compressor: %s (clip %.2f σ)", self.compressor, self.clip_sigma)
        log(_INFO, "\t│\t├── Downlink deltas: %s", self.downlink)
        log(_INFO, "\t│\t└── Error feedback: %s", self.error_feedback)
        self.strategy.summary()

    # ------------------------------------------------------------------ rounds
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the model as deltas where possible."""
        messages = self.strategy.configure_train(server_round, arrays, config, grid)
        return self._outgoing(messages, arrays)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode the replies, then aggregate them with the wrapped strategy."""
        return self.strategy.aggregate_train(server_round, self._incoming(replies))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages, with the model as deltas where possible."""
        messages = self.strategy.configure_evaluate(server_round, arrays, config, grid)
        return self._outgoing(messages, arrays)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Strip this wrapper's records, then aggregate with the wrapped strategy."""
        return self.strategy.aggregate_evaluate(server_round, self._incoming(replies))

    # ------------------------------------------------------------------ downlink
    def broadcast_model(self) -> ArrayRecord | None:
        """The model the nodes hold (the last broadcast), as an ArrayRecord."""
        if not self._names:
            return None
        return join_model(self._names, self._floats, self._others)

    def _advance(self, arrays: ArrayRecord) -> None:
        """Move the broadcast model towards ``arrays`` (once per distinct global model)."""
        target = split_model(arrays)
        target_digest = digest(target.floats) + "|" + _others_digest(target)
        if target_digest == self._target_digest:
            return  # e.g. the evaluation and the next training of one global model
        self._target_digest = target_digest
        fresh = not self._names or not same_layout(
            arrays, join_model(self._names, self._floats, self._others)
        )
        self._others = target.others
        self._exact = target.floats
        if fresh or not self.downlink:
            self._names = target.names
            self._floats = {n: t.clone() for n, t in target.floats.items()}
            self._log.clear()
        else:
            # the whole gap: what earlier deltas could not carry is part of it
            delta = {n: target.floats[n] - self._floats[n] for n in self._floats}
            compressor = make_compressor(
                self.compressor,
                seed=derive_seed(self.seed, 0x5E4D, self.version + 1),
                clip_sigma=self.clip_sigma,
            )
            payload = encode_update(delta, compressor)
            decoded = decode_update(payload, **limits_for(delta))  # what every client will add
            self._floats = {n: self._floats[n] + decoded[n] for n in self._floats}
            self._log.append((self.version + 1, payload))
            while len(self._log) > self.update_log_size:
                self._log.popleft()
        self.version += 1
        self._digest = digest(self._floats)

    def _outgoing(self, messages: Iterable[Message], arrays: ArrayRecord) -> list[Message]:
        out = []
        for message in messages:
            key = _model_key(message, arrays)
            node = message.metadata.dst_node_id
            if key is None or node in self._plain:
                out.append(message)
                continue
            self._advance(arrays)
            message.content = self._content_for(node, message.content, key)
            self._sent[node] = (self.version, message)
            out.append(message)
        return out

    def _content_for(self, node: int, content: RecordDict, key: str) -> RecordDict:
        held = self._held.get(node, -1)
        logged = {v for v, _ in self._log}
        delta = (
            self.downlink
            and held >= 1
            and all(v in logged for v in range(held + 1, self.version + 1))
        )
        out = RecordDict()
        for name, record in content.items():
            if name == key:
                record = (
                    ArrayRecord(dict(self._others))  # type: ignore[arg-type]
                    if delta
                    else join_model(self._names, self._floats, self._others)
                )
            out[name] = record
        if delta:
            updates = {update_key(v): bytes_to_array(p) for v, p in self._log if v > held}
            out[UPDATES] = ArrayRecord(updates)  # type: ignore[arg-type]
        out[META] = Broadcast(
            record=key,
            names=list(self._names),
            version=self.version,
            base=held if delta else -1,
            digest=self._digest,
            compressor=self.compressor,
            clip_sigma=self.clip_sigma,
            error_feedback=self.error_feedback,
            seed=self.seed,
        ).to_record()
        return out

    # ------------------------------------------------------------------ uplink
    def _incoming(self, replies: Iterable[Message]) -> list[Message]:
        restored = [self._restore(reply) for reply in replies]
        for node in self._sent:  # no reply: it may or may not hold the broadcast now
            self._held.pop(node, None)
        self._sent.clear()
        return [reply for reply in restored if reply is not None]

    def _restore(self, reply: Message) -> Message | None:
        node = reply.metadata.src_node_id
        sent = self._sent.pop(node, None)
        if reply.has_error():
            self._held.pop(node, None)
            return reply
        content = reply.content
        if META not in content:
            if sent is not None:  # the node runs no ternary_mod
                self._plain.add(node)
                self._held.pop(node, None)
            return reply
        if sent is None:
            self._count_drop("unexpected")
            log(_WARNING, "TernaryDelta dropped a reply of node %s: it answers no model "
                "this server sent in this exchange", node)
            return None
        version, instruction = sent
        try:
            reply.content = self._decoded(content, version)
        except (ValueError, KeyError, TypeError) as err:  # PayloadError is a ValueError
            reason = f"TernaryDelta dropped the reply of node {node}: {err}"
            log(_WARNING, reason)
            self._count_drop(type(err).__name__)
            self._held.pop(node, None)  # next time: the whole model
            error = Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason)
            return Message(error, reply_to=instruction)
        self._held[node] = version
        return reply

    def _count_drop(self, kind: str) -> None:
        self.dropped[kind] = self.dropped.get(kind, 0) + 1

    def _decoded(self, content: RecordDict, sent: int) -> RecordDict:
        """``content`` without this wrapper's records, the model decoded (or ValueError)."""
        meta = parse_reply_meta(content)
        if meta.version != sent:
            raise ValueError(f"it answers version {meta.version}, the server sent {sent}")
        out = RecordDict()
        for name, record in content.items():
            if name not in (META, DELTA):
                out[name] = record
        if meta.record is None:
            if DELTA in content:
                raise ValueError(f"it holds a {DELTA!r} record but names no model record")
            return out
        if meta.version != self.version or meta.names != self._names:
            raise ValueError("its delta is not against the current broadcast model")
        model_record = content.get(meta.record)
        if not isinstance(model_record, ArrayRecord):
            raise ValueError(f"it has no ArrayRecord {meta.record!r}")
        others = split_model(model_record)
        if others.floats or others.names != [n for n in self._names if n not in self._floats]:
            raise ValueError(f"record {meta.record!r} must hold exactly the non-float arrays")
        holder = content.get(DELTA)
        if not isinstance(holder, ArrayRecord) or DELTA_KEY not in holder:
            raise ValueError(f"it has no {DELTA!r} ArrayRecord with a {DELTA_KEY!r} Array")
        payload = array_to_bytes(holder[DELTA_KEY])
        limit = max_payload_bytes(self._floats)
        if len(payload) > limit:
            raise ValueError(f"its delta has {len(payload)} bytes, more than {limit}")
        delta = decode_update(payload, **limits_for(self._floats))
        if list(delta) != list(self._floats):
            raise PayloadError("its delta names other tensors than the model's float arrays")
        weights: dict[str, torch.Tensor] = {}
        for name, base in self._floats.items():
            d = delta[name]
            if d.shape != base.shape or d.dtype != base.dtype:
                raise PayloadError(f"its delta of {name!r} is {tuple(d.shape)}/{d.dtype}")
            if not bool(torch.isfinite(d).all()):
                raise PayloadError(f"its delta of {name!r} holds non-finite values")
            weights[name] = self._exact[name] + d  # the wrapped strategy's own model + delta
        out[meta.record] = join_model(self._names, weights, others.others)
        return out


def _model_key(message: Message, arrays: ArrayRecord) -> str | None:
    """Name of the record in ``message`` that carries the global model, if any."""
    if message.has_error() or not message.has_content():
        return None
    records = message.content.array_records
    for key, record in records.items():
        if record is arrays:
            return key
    for key, record in records.items():
        if same_layout(record, arrays):
            return key
    return None


def _others_digest(model: SplitModel) -> str:
    h = hashlib.sha256()
    for name, array in model.others.items():
        h.update(f"{name}|{array.dtype}|{tuple(array.shape)}|".encode())
        h.update(array.data)
    return h.hexdigest()[:32]
