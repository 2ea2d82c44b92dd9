"""What ``scale-bucket = "auto"`` (the default) means for a run.

A TernGrad-family run sends one ternary scale per output channel (:data:`PER_CHANNEL`) where
its settings carry scale buckets, and one scale per tensor (0, TernGrad as published) where
they do not: the ``shared-scale-sum`` downlink (one shared scale per tensor) and a compressor
that takes no ``scale_bucket`` (``ternary-entropy``; a plugin whose factory lacks the
argument). Tensors without an output-channel dimension (biases, 1-D) keep one scale either
way. An explicit value is used as given, and a non-zero one with such a setting is refused.
Server and clients resolve it from the same run config for the compressor the server names
(``compressor_name()``, the one its instructions tell the clients), so they always agree.
"""

from __future__ import annotations

__all__ = ["AUTO", "PER_CHANNEL", "parse_scale_bucket", "resolve_scale_bucket"]

AUTO = "auto"
#: One scale per output channel (``fedddl.compression.algorithms.ternary_buckets``).
PER_CHANNEL = -1


def parse_scale_bucket(value: object) -> int | str:
    """``"auto"`` or an int >= -1 from a run-config or command-line value (an int, or a
    string of one); raise ``ValueError`` naming the choices otherwise."""
    if value == AUTO:
        return AUTO
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = None
    if number is None or number < PER_CHANNEL:
        raise ValueError(
            f"scale-bucket must be 'auto', 0 (per tensor), N > 0 (buckets of N values) or "
            f"{PER_CHANNEL} (per output channel), got {value!r}"
        )
    return number


def resolve_scale_bucket(
    value: int | str, *, downlink: str, compressor: str, compressor_takes_buckets: bool
) -> int:
    """The scale buckets a run uses: ``value`` itself unless it is ``"auto"``, then
    :data:`PER_CHANNEL` where ``downlink`` (resolved, or ``"auto"``) is not
    ``"shared-scale-sum"`` and ``compressor_takes_buckets``, else 0.

    Raises
    ------
    ValueError
        For a non-zero ``value`` with the ``shared-scale-sum`` downlink or with a compressor
        (named ``compressor``) that takes no scale buckets, or a bad ``value``.
    """
    bucket = parse_scale_bucket(value)
    shared_sum = downlink == "shared-scale-sum"
    if isinstance(bucket, str):  # AUTO
        return 0 if shared_sum or not compressor_takes_buckets else PER_CHANNEL
    if bucket and shared_sum:
        raise ValueError(
            f"scale-bucket {bucket} needs downlink 'reternarize' or 'grid' (the shared-scale "
            "sum needs one scale per tensor); use scale-bucket 0 or 'auto'"
        )
    if bucket and not compressor_takes_buckets:
        raise ValueError(
            f"scale-bucket {bucket}: compressor {compressor!r} sends one scale per tensor; "
            "use scale-bucket 0 or 'auto'"
        )
    return bucket
