"""TernGrad: localized replicas, ternary gradients up, compressed aggregate down.

A Flower :class:`~flwr.serverapp.strategy.Strategy` that owns a Flower-free
:class:`~fedddl.sync.server.ReplicaServer` (catch-up planner, reply admission, aggregation
and downlink, shadow replica) and carries its override points: a variant overrides one of
:meth:`TernGrad.compressor_name`, :meth:`TernGrad.validate_reply`,
:meth:`TernGrad.aggregate_gradients`, :meth:`TernGrad.encode_downlink`, as Flower's
``FedMedian`` overrides one method of ``FedAvg``. Model weights never travel, except as a
catch-up snapshot; the ServerApp evaluates the shadow replica (:meth:`global_model`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from fedddl.app_config import AppConfig
from fedddl.checkpoint import ServerCheckpoint
from fedddl.flower.logs import use_flower_logging
from fedddl.flower.protocol import MAX_EXAMPLES, build_train_content, parse_reply
from fedddl.sync import (
    Aggregate,
    ClientReply,
    Contribution,
    FingerprintMismatch,
    ParseFailure,
    ReplicaServer,
    ReplyError,
)
from fedddl.sync import RoundReport as RoundReport
from fedddl.sync.server import DEFAULT_COMPRESSOR
from strategies.sampling import sample_nodes

__all__ = ["FingerprintMismatch", "RoundReport", "TernGrad"]


class TernGrad(Strategy):
    """Synchronous data-parallel SGD with ternary gradients and a versioned shadow replica.

    Parameters
    ----------
    model_fn : Callable[[], torch.nn.Module]
        Builds the seeded initial model (identical to what every client builds).
    fraction_train : float
        Fraction of connected nodes sampled per round.
    min_available_nodes : int
        Nodes to wait for before sampling.
    wait_timeout : float
        Seconds to wait for ``min_available_nodes`` before failing.
    max_examples : int
        Largest ``num-examples`` a reply may report (larger: dropped).
    compressor : str
        The uplink compressor (:meth:`compressor_name`'s default).
    **server : Any
        The other :class:`~fedddl.sync.server.ReplicaServer` settings.

    Attributes
    ----------
    server : ReplicaServer
        The parts, with this strategy as their override points; the server's state
        (``shadow``, ``log``, ``reports``, ``fingerprints``, ...) is read there.
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        *,
        fraction_train: float = 1.0,
        min_available_nodes: int = 2,
        wait_timeout: float = 600.0,
        max_examples: int = MAX_EXAMPLES,
        compressor: str = DEFAULT_COMPRESSOR,
        **server: Any,
    ) -> None:
        if not 0 < fraction_train <= 1:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        self.compressor = compressor
        self.server = ReplicaServer(model_fn, compressor=compressor, hooks=self, **server)
        self.fraction_train = fraction_train
        self.min_available_nodes = min_available_nodes
        self.wait_timeout = wait_timeout
        self.max_examples = max_examples
        use_flower_logging()

    @classmethod
    def from_app_config(cls, cfg: AppConfig, model_fn: Callable[[], nn.Module]) -> TernGrad:
        """Build this strategy (or a subclass) from a run's :class:`AppConfig`."""
        return cls(
            model_fn,
            learning_rate=cfg.learning_rate,
            momentum=cfg.momentum,
            lr_decay=cfg.lr_decay(),
            compressor=cfg.compressor,
            clip_sigma=cfg.clip_sigma,
            downlink=cfg.resolved_downlink,
            fraction_train=cfg.fraction_train,
            min_available_nodes=cfg.min_available_nodes,
            min_replies=cfg.min_replies,
            update_log_size=cfg.update_log_size,
            grid_levels=cfg.grid_levels,
            grid_log_size=cfg.grid_log_size,
            seed=cfg.seed,
            defenses=cfg.defenses(),
            max_examples=cfg.batch_size * cfg.local_steps,
            fp32_min_numel=cfg.fp32_min_numel,
            fp32_logits=cfg.fp32_logits,
            fp32_warmup_rounds=cfg.fp32_warmup_rounds,
            scale_bucket=cfg.scale_bucket,  # "auto": resolved for compressor_name()
        )

    # ------------------------------------------------------------ override points
    def compressor_name(self) -> str:
        """Override point: the uplink compressor clients use (and the server re-encodes with)."""
        return self.compressor

    def validate_reply(self, reply: ClientReply, expected_version: int | None) -> None:
        """Override point: raise a ``ReplyError`` subclass to drop a reply that does not fit
        the round (default: not asked, a resync request, wrong version or fingerprint)."""
        self.server.validate_reply(reply, expected_version)

    def aggregate_gradients(self, contributions: Iterable[Contribution]) -> Aggregate:
        """Override point: combine the admitted gradients, each in a buffer the next one
        overwrites (default: the configured aggregator of :mod:`fedddl.sync.robust`)."""
        return self.server.aggregate_gradients(contributions)

    def encode_downlink(self, server_round: int, aggregate: Aggregate) -> tuple[bytes, str]:
        """Override point: the broadcast bytes of the aggregate, its pooled statistics
        included, and their format (default: the shared-scale sum when it applies, else the
        re-encoded aggregate)."""
        return self.server.encode_downlink(server_round, aggregate)

    # ------------------------------------ what the ServerApp asks (ReplicaStrategy)
    def round_report(self) -> RoundReport | None:
        """The report of the latest aggregated round (None before the first)."""
        return self.server.last_report

    def global_model(self) -> nn.Module:
        """The shadow replica's model (what every client replica equals)."""
        return self.server.shadow.model

    def model_version(self) -> int:
        """The shadow replica's version."""
        return self.server.shadow.version

    def checkpoint(self, server_round: int, config: dict[str, object]) -> ServerCheckpoint:
        """The state to save after global round ``server_round``."""
        return self.server.checkpoint(server_round, config)

    def restore(self, ckpt: ServerCheckpoint) -> None:
        """Continue from ``ckpt`` (raises ``CheckpointError`` and changes nothing if unfit)."""
        self.server.restore(ckpt)

    # -------------------------------------------------------------- training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node: missed updates (or a snapshot) + compute order."""
        del arrays, config  # the protocol never broadcasts weights
        server_round += self.server.round_offset
        nodes = sample_nodes(
            grid,
            fraction=self.fraction_train,
            min_available_nodes=self.min_available_nodes,
            seed=self.server.seed,
            server_round=server_round,
            wait_timeout=self.wait_timeout,
        )
        contents: dict[int, RecordDict] = {}  # one content per shared instruction
        messages: list[Message] = []
        for node, instruction in self.server.plan_round(server_round, nodes).items():
            content = contents.get(id(instruction))
            if content is None:
                content = contents[id(instruction)] = build_train_content(instruction)
            messages.append(
                Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            )
        version = self.model_version()
        log(INFO, "configure_train: %d nodes, model version %d", len(messages), version)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Parse the replies, aggregate them into the shadow replica, report the round.

        Returns no arrays: the shadow replica stays where it lives (no per-round copy of the
        model into a record); the ServerApp evaluates :meth:`global_model` directly.
        """
        global_round = server_round + self.server.round_offset
        report = self.server.aggregate(global_round, _parsed(replies, self.max_examples))
        metrics = MetricRecord(
            {
                "num-accepted": len(report.accepted),
                "num-dropped": len(report.dropped),
                "model-version": report.version,
                "replicas-equal": -1
                if report.replicas_equal is None
                else int(report.replicas_equal),
            }
        )
        if not math.isnan(report.loss):
            metrics["train-loss"] = report.loss
        return None, metrics

    # ------------------------------------------------------------ evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the ServerApp evaluates the shadow replica."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    def summary(self) -> None:
        """Log the strategy configuration."""
        server, bound = self.server, self.server.scale_bound
        log(INFO, "\t├──> Uplink compressor: %s", self.compressor_name())
        log(INFO, "\t├──> Downlink: %s", server.downlink)
        log(INFO, "\t├──> Fraction train: %.2f", self.fraction_train)
        log(INFO, "\t├──> Min replies: %d", server.min_replies)
        log(INFO, "\t├──> Aggregator: %s", server.defenses.aggregator)
        log(INFO, "\t├──> Scale bound: %g (%s)", bound.factor, bound.action)
        log(INFO, "\t└──> Update log size: %d", server.log.capacity)


def _parsed(replies: Iterable[Message], max_examples: int) -> Iterator[ClientReply | ParseFailure]:
    """Each reply parsed, or the reason it could not be (any exception: the reply's fault)."""
    for message in replies:
        try:
            yield parse_reply(message, max_examples=max_examples)
        except ReplyError as err:
            yield ParseFailure(_sender(message), err)
        except Exception as err:  # a malformed message must not end the round
            reason = f"node {_sender(message)} reply unreadable: {type(err).__name__}: {err}"
            yield ParseFailure(_sender(message), ReplyError(reason))


def _sender(message: Message) -> int:
    try:
        return int(message.metadata.src_node_id)
    except Exception:  # no usable metadata
        return -1
