"""fedddl's Flower layer shared by both sides: the only ``fedddl`` package that imports flwr.

* :mod:`fedddl.flower.protocol`: the localized-replica protocol in Flower messages (every
  record and key), imported by ``strategies/`` and ``clients/`` alike;
* :mod:`fedddl.flower.records`: raw bytes and tensors in Flower records;
* :mod:`fedddl.flower.grid`: Grid wrappers (byte counting, fast reply polling);
* :mod:`fedddl.flower.simulation`: the in-process simulation runner (an entry point);
* :mod:`fedddl.flower.inline_grid`: the inline engine (``InlineGrid``, a Ray-free Grid);
* :mod:`fedddl.flower.fast_supernode`, :mod:`fedddl.deploy.warm_clientapp`: deployment
  helpers that patch Flower's polling and ClientApp start-up;
* :mod:`fedddl.flower.logs`: the core's log records in Flower's log;
* :mod:`fedddl.flower.run_config`: ``--run-config`` text in Flower's syntax.

Ternary compression for *any* Flower app (its own ServerApp and ClientApp):

* ``fedddl.flower.ternary_mod`` (:mod:`fedddl.flower.delta_mod`): the client mod;
* ``fedddl.flower.TernaryDelta`` (:mod:`fedddl.flower.ternary_delta`): the strategy
  wrapper (downlink :mod:`~fedddl.flower.delta_broadcast`, reply admission
  :mod:`~fedddl.flower.delta_admission`, traffic metrics and plain notices
  :mod:`~fedddl.flower.delta_traffic`); their messages: :mod:`fedddl.flower.delta_protocol`.

Heavy imports stay in the submodules (the two names above are imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedddl.flower.delta_mod import ternary_mod as ternary_mod
    from fedddl.flower.ternary_delta import TernaryDelta as TernaryDelta

__all__ = ["TernaryDelta", "ternary_mod"]


def __getattr__(name: str) -> Any:
    """``ternary_mod`` and ``TernaryDelta``, imported on first use."""
    if name == "ternary_mod":
        from fedddl.flower.delta_mod import ternary_mod

        return ternary_mod
    if name == "TernaryDelta":
        from fedddl.flower.ternary_delta import TernaryDelta

        return TernaryDelta
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
