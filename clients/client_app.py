"""The fedddl ClientApp: one app for TernGrad, GradientAverage and stock FedAvg messages.

``app`` (used by ``flwr run``) reads its :class:`~fedddl.app_config.AppConfig`
from ``context.run_config``; :func:`make_client_app` binds a given config (the
in-process ``fedddl simulate`` path, where ``run_config`` is empty).
A TRAIN message whose ``config`` record has ``model-version`` follows the
localized-replica protocol; one with an ``arrays`` record is FedAvg.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from clients.fedavg_client import handle_fedavg_evaluate, handle_fedavg_train
from clients.localized import handle_localized_train
from clients.malicious import handle_malicious_train, is_attacker
from clients.roll_call import handle_roll_call
from clients.state import cached_replicas
from fedddl.app_config import AppConfig
from fedddl.flower.protocol import (
    CLIENT_CACHED,
    CLIENT_SECONDS,
    FEDAVG_ARRAYS,
    METRICS,
    is_localized_train,
)
from fedddl.flower.records import record_of
from fedddl.flower.roll_call import ACTION as ROLL_CALL

__all__ = ["app", "handle_train", "make_client_app"]


def handle_train(message: Message, context: Context, cfg: AppConfig) -> Message:
    """Dispatch a TRAIN message to the protocol it belongs to.

    With ``FEDDDL_CLIENT_TIMING=1`` in the environment, the reply's ``metrics`` record
    also carries ``client-s`` (seconds spent in this handler) and ``client-cached`` (how
    many live replicas this process keeps between messages, at most one per run):
    diagnostics that add a few bytes to every reply.
    """
    _single_thread()
    start = time.perf_counter()
    reply = _dispatch(message, context, cfg)
    if os.environ.get("FEDDDL_CLIENT_TIMING") == "1" and not reply.has_error():
        metrics = record_of(reply.content, METRICS, MetricRecord)
        if metrics is not None:
            metrics[CLIENT_SECONDS] = time.perf_counter() - start
            metrics[CLIENT_CACHED] = cached_replicas()
    return reply


def _dispatch(message: Message, context: Context, cfg: AppConfig) -> Message:
    if is_localized_train(message.content):
        if cfg.num_attackers and is_attacker(context, cfg):  # attack evaluation only
            return handle_malicious_train(message, context, cfg)
        return handle_localized_train(message, context, cfg)
    if isinstance(message.content.get(FEDAVG_ARRAYS), ArrayRecord):
        return handle_fedavg_train(message, context, cfg)
    raise ValueError(
        "train message is neither the localized protocol (config.model-version) "
        "nor FedAvg (an 'arrays' ArrayRecord)"
    )


def _single_thread() -> None:
    """One intra-op thread per client: many small clients share the cores."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def make_client_app(cfg: AppConfig | None = None) -> ClientApp:
    """Build a ClientApp bound to ``cfg`` (None: read ``context.run_config`` each message).

    An app bound to a config pickles as that config (:class:`_BoundClientApp`).
    """
    client = ClientApp() if cfg is None else _BoundClientApp(cfg)

    def config_of(context: Context) -> AppConfig:
        run_cfg = cfg if cfg is not None else AppConfig.from_run_config(context.run_config)
        run_cfg.import_plugins()
        return run_cfg

    @client.train()
    def train(message: Message, context: Context) -> Message:
        return handle_train(message, context, config_of(context))

    @client.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        _single_thread()
        return handle_fedavg_evaluate(message, context, config_of(context))

    # Gossip mode: membership/status queries from the coordinator; the models go peer to peer.
    from clients.gossip_client import handle_gossip

    client.query("gossip")(handle_gossip)
    # Attack evaluation: which node holds which partition (fedddl.flower.roll_call).
    client.query(ROLL_CALL)(handle_roll_call)
    return client


class _BoundClientApp(ClientApp):
    """A ClientApp bound to one config that pickles as a reference to it.

    Flower's Ray simulation pickles the ClientApp object with every message (the engine's
    app loader is a closure over it). Pickled as ``(config,)``, it is built once per process
    and config and then looked up (:func:`_client_app_for`); costs in ``docs/round-time.md``.
    """

    def __init__(self, cfg: AppConfig) -> None:
        super().__init__()
        self.fedddl_config = cfg

    def __reduce__(self) -> tuple[Any, ...]:
        return (_client_app_for, (self.fedddl_config,))


#: Apps built by :func:`_client_app_for` in this process, newest last.
_bound_apps: OrderedDict[AppConfig, ClientApp] = OrderedDict()
_BOUND_APPS_KEPT = 4


def _client_app_for(cfg: AppConfig) -> ClientApp:
    """The app bound to ``cfg`` in this process (built on first use; a few configs kept)."""
    found = _bound_apps.pop(cfg, None)
    if found is None:
        found = make_client_app(cfg)
    _bound_apps[cfg] = found
    while len(_bound_apps) > _BOUND_APPS_KEPT:
        _bound_apps.popitem(last=False)
    return found


app = make_client_app()
