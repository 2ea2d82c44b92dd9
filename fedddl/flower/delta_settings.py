"""``check_settings``: the checks on :class:`~fedddl.flower.TernaryDelta`'s settings.

Each bad setting raises ``ValueError`` naming it, in the order the checks run; the
compressor's own checks (unknown name, bad ``scale_bucket``) and the downlink's
(:func:`~fedddl.flower.delta_broadcast.downlink_mode`) run here too.
"""

from __future__ import annotations

from fedddl.compression import TernaryCompressor, make_compressor
from fedddl.flower.delta_broadcast import downlink_mode

__all__ = ["check_settings"]


def check_settings(
    *,
    compressor: str,
    clip_sigma: float,
    downlink: bool | str,
    update_log_size: int,
    grid_levels: int,
    grid_log_size: int,
    resync_interval: int,
    downlink_steps: int,
    threshold_warmup_rounds: int,
    warmup_threshold: float,
    scale_bucket: int,
) -> str:
    """Raise ``ValueError`` on the first bad setting; return the downlink mode.

    Returns
    -------
    str
        ``"grid"``, ``"delta"`` or ``"none"`` (``downlink`` normalised).
    """
    if update_log_size < 0:
        raise ValueError(f"update_log_size must be >= 0, got {update_log_size}")
    if threshold_warmup_rounds < 0:
        raise ValueError(f"threshold_warmup_rounds must be >= 0, got {threshold_warmup_rounds}")
    if not 0.0 <= warmup_threshold <= 1.0:
        raise ValueError(f"warmup_threshold must be in [0, 1], got {warmup_threshold}")
    if downlink_steps < 1:
        raise ValueError(f"downlink_steps must be >= 1, got {downlink_steps}")
    if not clip_sigma > 0:
        raise ValueError(f"clip_sigma must be > 0, got {clip_sigma}")
    built = make_compressor(  # unknown name, bad scale_bucket: ValueError
        compressor, seed=0, clip_sigma=clip_sigma, scale_bucket=scale_bucket
    )
    if threshold_warmup_rounds and not isinstance(built, TernaryCompressor):
        raise ValueError(
            f"threshold_warmup_rounds needs a compressor with a cut (a threshold ternary one, "
            f"e.g. 'ternary-projected-base3'); {compressor!r} has none"
        )
    mode = downlink_mode(downlink, grid_levels, grid_log_size, resync_interval)
    if mode != "delta" and downlink_steps != 1:
        raise ValueError(
            f"downlink_steps applies to the delta downlink only (downlink='delta'), not {mode!r}"
        )
    return mode
