"""Strategies by name: built-ins and user classes given as ``"module:Class"``.

A user class is built with ``Class.from_app_config(cfg, model_fn)`` when it defines
that classmethod (as :class:`~strategies.terngrad.TernGrad` and its subclasses do),
else with ``Class()``.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.serverapp.strategy import FedAvg, Strategy
from torch import nn

from fedddl.app_config import AppConfig
from fedddl.import_spec import import_attribute
from strategies.gradient_average import GradientAverage
from strategies.terngrad import TernGrad

__all__ = ["build_strategy", "load_strategy_class"]


def load_strategy_class(spec: str) -> type[Strategy]:
    """Import ``"package.module:Class"`` and check it is a Flower Strategy.

    Raises
    ------
    ValueError
        If the spec is malformed, the module or class is missing, or it is not a Strategy.
    """
    cls, _, class_name = import_attribute(spec, "strategy", "package.module:Class")
    if not isinstance(cls, type) or not issubclass(cls, Strategy):
        raise ValueError(f"strategy {spec!r}: {class_name!r} is not a flwr Strategy subclass")
    return cls


def build_strategy(cfg: AppConfig, model_fn: Callable[[], nn.Module]) -> Strategy:
    """Return the strategy named by ``cfg.strategy``."""
    if cfg.strategy == "terngrad":
        return TernGrad.from_app_config(cfg, model_fn)
    if cfg.strategy == "gradient-average":
        return GradientAverage.from_app_config(cfg, model_fn)
    if cfg.strategy == "fedavg":
        return FedAvg(
            fraction_train=cfg.fraction_train,
            fraction_evaluate=0.0,
            min_train_nodes=1,
            min_evaluate_nodes=0,
            min_available_nodes=cfg.min_available_nodes,
        )
    cls = load_strategy_class(cfg.strategy)
    factory = getattr(cls, "from_app_config", None)
    strategy = factory(cfg, model_fn) if callable(factory) else cls()
    if not isinstance(strategy, Strategy):
        raise ValueError(f"strategy {cfg.strategy!r} did not build a flwr Strategy")
    return strategy
