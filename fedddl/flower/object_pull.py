"""Shorter retry waits for Flower 1.42's object pulls (opt-in, per process).

Flower hands a message to whoever pulls it as soon as the sender has registered it,
*before* the sender has pushed the message's objects (its arrays). Pulling an object
that has not arrived yet raises ``ObjectUnavailableError``, and
``flwr.supercore.inflatable.inflatable_utils.pull_objects`` retries it after 1 s, then
2, 4, ... up to 10 s (each +-20 %). Where the objects cross a slow link, the puller
nearly always comes early, so a message that finishes arriving just after a pull waits
up to a whole backoff step more: the ServerApp pulling a reply that its SuperNode still
uploads, and a ClientApp pulling an instruction that its SuperNode still downloads.

:func:`patch_object_pulls` rebinds ``pull_objects`` / ``pull_and_inflate_object_from_tree``
in the Flower modules that call them (the ServerApp's ``HttpGrid``, the SuperNode's main
loop, the ClientApp runtime) to the same functions with a short, capped backoff and no
retry count limit (the overall ``PULL_MAX_TIME`` still bounds a pull). Idempotent; it
refuses to patch modules that do not look like Flower 1.42's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

__all__ = ["BACKOFF_CAP_S", "CLIENTAPP", "INITIAL_BACKOFF_S", "PATCH_SITES", "SERVERAPP",
           "SUPERNODE", "patch_clientapp_pulls", "patch_object_pulls"]

#: First wait after an object was not yet available (Flower: 1 s).
INITIAL_BACKOFF_S = 0.05
#: Longest wait between two pulls of one object (Flower: 10 s).
BACKOFF_CAP_S = 0.2
#: The ServerApp's grid (pulls replies from the SuperLink).
SERVERAPP = "flwr.superlink.grid.http_grid"
#: The SuperNode's main loop (pulls instructions from the SuperLink).
SUPERNODE = "flwr.supernode.start_client_internal"
#: The ClientApp runtime (pulls its instruction from the SuperNode).
CLIENTAPP = "flwr.supernode.runtime.run_clientapp"
#: Module -> the function in it that is rebound.
PATCH_SITES: dict[str, str] = {
    SERVERAPP: "pull_objects",
    SUPERNODE: "pull_objects",
    CLIENTAPP: "pull_and_inflate_object_from_tree",
}
_BACKOFF_ARGS = frozenset({"initial_backoff", "backoff_cap", "max_tries_per_object"})
_MARK = "_fedddl_fast_pull"


def _with_short_backoff(original: Any, initial_backoff_s: float, backoff_cap_s: float) -> Any:
    @functools.wraps(original)
    def fast(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("initial_backoff", initial_backoff_s)
        kwargs.setdefault("backoff_cap", backoff_cap_s)
        kwargs.setdefault("max_tries_per_object", None)
        return original(*args, **kwargs)

    setattr(fast, _MARK, True)
    return fast


def patch_object_pulls(
    *modules: str,
    initial_backoff_s: float = INITIAL_BACKOFF_S,
    backoff_cap_s: float = BACKOFF_CAP_S,
) -> list[str]:
    """Rebind the object-pull function of each of ``modules`` (all :data:`PATCH_SITES` if
    none are named); return the ``module.function`` names patched.

    Patching a site again replaces the earlier waits.

    Raises
    ------
    ValueError
        If a wait is not positive, the cap is below the first wait, or a module is not a site.
    RuntimeError
        If a site lacks the function or the function does not take the backoff arguments.
    """
    if not 0 < initial_backoff_s <= backoff_cap_s:
        raise ValueError(
            f"need 0 < initial_backoff_s <= backoff_cap_s, got {initial_backoff_s}, "
            f"{backoff_cap_s}")
    unknown = set(modules) - set(PATCH_SITES)
    if unknown:
        raise ValueError(f"not an object-pull site: {sorted(unknown)}")
    patched = []
    for module_name in modules or tuple(PATCH_SITES):
        name = PATCH_SITES[module_name]
        module = importlib.import_module(module_name)
        function = getattr(module, name, None)
        if getattr(function, _MARK, False):
            function = function.__wrapped__  # type: ignore[union-attr]
        params = set(inspect.signature(function).parameters) if callable(function) else set()
        if not params >= _BACKOFF_ARGS:
            raise RuntimeError(
                f"{module_name}.{name} does not look like Flower 1.42's (no backoff "
                "arguments); not patching")
        setattr(module, name, _with_short_backoff(function, initial_backoff_s, backoff_cap_s))
        patched.append(f"{module_name}.{name}")
    return patched


def patch_clientapp_pulls() -> None:
    """Patch the ClientApp runtime's pull (a ``module:function`` fork-server preload entry)."""
    patch_object_pulls(CLIENTAPP)
