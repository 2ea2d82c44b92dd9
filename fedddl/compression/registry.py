"""Compressors by name, so users can plug in their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedddl.compression.base import Compressor
from fedddl.compression.identity import IdentityCompressor
from fedddl.compression.ternary import TernaryCompressor

__all__ = ["available_compressors", "get_compressor", "register_compressor"]

CompressorFactory = Callable[..., Compressor]

_REGISTRY: dict[str, CompressorFactory] = {}


def register_compressor(name: str, factory: CompressorFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(**kwargs) -> Compressor`` under ``name``.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered (unless ``overwrite``).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"compressor name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} is not callable")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"compressor {name!r} is already registered")
    _REGISTRY[name] = factory


def get_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build the compressor registered as ``name`` with ``kwargs``.

    Raises
    ------
    KeyError
        If ``name`` is unknown (the message lists the known names).
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown compressor {name!r}; available: {', '.join(available_compressors())}"
        ) from None
    compressor = factory(**kwargs)
    if not isinstance(compressor, Compressor):
        kind = type(compressor).__name__
        raise TypeError(f"factory for {name!r} returned {kind}, not a Compressor")
    return compressor


def available_compressors() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def _ternary_base3(**kwargs: Any) -> Compressor:
    return TernaryCompressor(codec="base3", **kwargs)


register_compressor("ternary", TernaryCompressor)
register_compressor("ternary-base3", _ternary_base3)
register_compressor("identity", IdentityCompressor)
