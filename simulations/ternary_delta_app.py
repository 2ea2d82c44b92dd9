"""``TernaryDelta(FedAvg)`` on the project's FedAvg client app, for the benchmarks.

:class:`TernaryDeltaFedAvg` is built by name (``strategy =
"simulations.ternary_delta_app:TernaryDeltaFedAvg"``) from an :class:`~fedddl.app_config.AppConfig`:
the built-in FedAvg of ``cfg`` wrapped in :class:`~fedddl.flower.TernaryDelta`, with the
``grid`` downlink when ``cfg.downlink`` is ``"grid"`` (``grid-levels``; the wrapper's own
log size) and the ternary deltas otherwise (:class:`TernaryDeltaFedAvgAllMod`: with ``assume_mod``).
:func:`make_delta_client_app` is the project's
client app with :func:`~fedddl.flower.ternary_mod` added, as a user would add it.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.flower import TernaryDelta, ternary_mod
from strategies.registry import build_strategy

__all__ = ["TernaryDeltaFedAvg", "TernaryDeltaFedAvgAllMod", "make_delta_client_app"]


class TernaryDeltaFedAvg(TernaryDelta):
    """:class:`~fedddl.flower.TernaryDelta` around the FedAvg of an AppConfig."""

    #: The ``assume_mod`` setting of the ``grid`` downlink.
    ALL_MOD = False

    @classmethod
    def from_app_config(
        cls, cfg: AppConfig, model_fn: Callable[[], nn.Module]
    ) -> TernaryDeltaFedAvg:
        """The FedAvg of ``cfg`` (its fraction and nodes), wrapped; see the module docstring."""
        from dataclasses import replace

        fedavg = build_strategy(replace(cfg, strategy="fedavg"), model_fn)
        grid = cfg.downlink == "grid"
        return cls(
            fedavg,
            downlink="grid" if grid else "delta",
            grid_levels=cfg.grid_levels,
            assume_mod=cls.ALL_MOD,
            seed=cfg.seed,
        )


class TernaryDeltaFedAvgAllMod(TernaryDeltaFedAvg):
    """:class:`TernaryDeltaFedAvg` with ``assume_mod``: grid messages from a node's first."""

    ALL_MOD = True


def make_delta_client_app(cfg: AppConfig) -> ClientApp:
    """The client app of ``cfg`` behind ``ternary_mod``."""
    inner = make_client_app(cfg)
    app = ClientApp(mods=[ternary_mod])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return inner(message, context)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return inner(message, context)

    return app
