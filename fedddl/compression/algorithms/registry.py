"""Compressors by name, so users can plug in their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedddl.compression.algorithms.base import Compressor
from fedddl.compression.algorithms.identity import IdentityCompressor
from fedddl.compression.algorithms.quinary_projected import QuinaryProjectedCompressor
from fedddl.compression.algorithms.ternary import TernaryCompressor, TernaryEntropyCompressor
from fedddl.compression.algorithms.ternary_fitted import FittedTernaryCompressor
from fedddl.compression.algorithms.ternary_projected import ProjectedTernaryCompressor

__all__ = [
    "available_compressors",
    "get_compressor",
    "is_ternary",
    "make_compressor",
    "register_compressor",
    "takes_scale_bucket",
]

CompressorFactory = Callable[..., Compressor]

_REGISTRY: dict[str, CompressorFactory] = {}
#: Whether each registered name builds a ternary / a configurable compressor, read from its
#: first build.
_CAPS: dict[str, tuple[bool, bool]] = {}
#: Whether each registered name builds with ``scale_bucket`` set, read from one build.
_TAKES_BUCKET: dict[str, bool] = {}


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
    _CAPS.pop(name, None)
    _TAKES_BUCKET.pop(name, None)


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


def make_compressor(
    name: str, *, seed: int, clip_sigma: float, scale_bucket: int = 0
) -> Compressor:
    """Build the compressor registered as ``name`` for one use (one message, one seed).

    A compressor whose :attr:`~fedddl.compression.Compressor.ternary` or
    :attr:`~fedddl.compression.Compressor.configurable` capability is set is built with
    ``seed`` and ``clip_sigma``, and a ternary one with ``scale_bucket`` when not 0 (its
    factory must accept it); any other with its factory's defaults (``scale_bucket``
    ignored).

    Raises
    ------
    ValueError
        If ``name`` is not registered, or ``scale_bucket`` is not 0 for a configurable
        compressor that has one scale per tensor or a ternary one whose factory refuses it.
    """
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown compressor {name!r}; registered: {', '.join(available_compressors())}"
        )
    caps = _CAPS.get(name)
    if caps is None:  # the capabilities, from one build with the factory's defaults
        compressor = get_compressor(name)
        caps = _CAPS[name] = (
            bool(compressor.ternary), bool(compressor.ternary or compressor.configurable))
        if not caps[1]:
            return compressor
    ternary, configurable = caps
    if not configurable:
        return get_compressor(name)
    if scale_bucket and not ternary:
        raise ValueError(f"compressor {name!r} does not take scale_bucket: one scale per tensor")
    if scale_bucket:
        try:
            return get_compressor(
                name, seed=seed, clip_sigma=clip_sigma, scale_bucket=scale_bucket
            )
        except TypeError as error:
            raise ValueError(f"compressor {name!r} does not take scale_bucket: {error}") from None
    return get_compressor(name, seed=seed, clip_sigma=clip_sigma)


def is_ternary(name: str) -> bool:
    """Whether the compressor registered as ``name`` has the ``ternary`` capability.

    Raises
    ------
    ValueError
        If ``name`` is not registered.
    """
    return make_compressor(name, seed=0, clip_sigma=2.5).ternary


def takes_scale_bucket(name: str) -> bool:
    """Whether the compressor registered as ``name`` builds with a non-zero ``scale_bucket``
    (:func:`make_compressor`): a ternary compressor whose factory accepts it, or one with
    neither the ``ternary`` nor the ``configurable`` capability (which ignores it).

    Raises
    ------
    ValueError
        If ``name`` is not registered.
    """
    takes = _TAKES_BUCKET.get(name)
    if takes is None:
        if name not in _REGISTRY:
            make_compressor(name, seed=0, clip_sigma=2.5)  # raises, naming the known ones
        try:
            make_compressor(name, seed=0, clip_sigma=2.5, scale_bucket=-1)
            takes = True
        except ValueError:
            takes = False
        _TAKES_BUCKET[name] = takes
    return takes


def available_compressors() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def _ternary_base3(**kwargs: Any) -> Compressor:
    return TernaryCompressor(codec="base3", **kwargs)


def _ternary_threshold(**kwargs: Any) -> Compressor:
    return TernaryCompressor(deterministic=True, **kwargs)


def _ternary_threshold_base3(**kwargs: Any) -> Compressor:
    return TernaryCompressor(deterministic=True, codec="base3", **kwargs)


register_compressor("ternary", TernaryCompressor)
register_compressor("ternary-base3", _ternary_base3)
register_compressor("ternary-entropy", TernaryEntropyCompressor)
# Deterministic threshold ternary (biased, contractive: |error| <= |input| per value), the
# pairing for error feedback on whole model deltas (fedddl.flower.TernaryDelta).
register_compressor("ternary-threshold", _ternary_threshold)
register_compressor("ternary-threshold-base3", _ternary_threshold_base3)
# The same codes with the least-squares scale of each tensor (lower error, same bytes).
register_compressor("ternary-fitted-base3", FittedTernaryCompressor)
# The same codes with the scale that keeps each delta's length along itself (the drop-in's
# default with the cut 0.35: docs/results/dropin-accuracy.md).
register_compressor("ternary-projected-base3", ProjectedTernaryCompressor)
# Five levels with the same projection-keeping scale: 7/3 bits a value, about half the
# ternary codes' error (docs/results/dropin-accuracy.md, eighth round).
register_compressor("quinary-projected-base5", QuinaryProjectedCompressor)
register_compressor("identity", IdentityCompressor)
