"""A run's checkpoint directory: file names by round, the newest readable checkpoint (with
the rollback checks of the high-water mark, :mod:`fedddl.checkpoint_mark`), pruning.

The file format is :mod:`fedddl.checkpoint`.
"""

from __future__ import annotations

from logging import WARNING, getLogger
from pathlib import Path

from fedddl.checkpoint import CHECKPOINT_NAME, ServerCheckpoint, load_checkpoint
from fedddl.checkpoint_io import CheckpointError
from fedddl.checkpoint_mark import HighWaterMark, read_mark

__all__ = [
    "checkpoint_path",
    "latest_checkpoint",
    "load_latest_checkpoint",
    "prune_checkpoints",
]

logger = getLogger("fedddl")


def checkpoint_path(directory: str | Path, server_round: int) -> Path:
    """The conventional file for ``server_round`` in ``directory``: ``round-000012.ckpt``."""
    if server_round < 0:
        raise ValueError(f"server_round must be >= 0, got {server_round}")
    return Path(directory) / f"round-{server_round:06d}.ckpt"


def _rounds_in(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = CHECKPOINT_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest ``round-*.ckpt`` in ``directory`` (by round), or None if there is none."""
    rounds = _rounds_in(Path(directory))
    return rounds[-1][1] if rounds else None


def load_latest_checkpoint(
    directory: str | Path,
    *,
    skip_corrupt: bool = True,
    key: bytes | None = None,
    allow_fresh_start: bool = False,
    max_round: int | None = None,
) -> tuple[Path, ServerCheckpoint] | None:
    """Load the newest readable round checkpoint (``round-*.ckpt``) in ``directory``.

    With ``skip_corrupt`` a checkpoint that fails verification (see :func:`load_checkpoint`;
    also a round above ``max_round``, or with a key a checkpoint of another run than the
    directory's high-water mark names) is skipped, with its reason logged at WARNING, and
    the next older one tried; otherwise its :class:`CheckpointError` is raised. ``key``:
    see :func:`load_checkpoint`. With ``key``, the directory's high-water mark
    (:mod:`fedddl.checkpoint_mark`) must verify and the checkpoint found must not be older
    than the round it records (nor, without a mark, hold a ``run_id``: the mark was
    deleted); a rollback is refused, or with ``allow_fresh_start`` logged at WARNING
    naming both rounds (the older checkpoint, or none, is then used).

    Returns
    -------
    tuple[Path, ServerCheckpoint] | None
        None when the directory holds no checkpoint file (and no mark of a saved round),
        or (with ``allow_fresh_start``) when none of them is readable.

    Raises
    ------
    CheckpointError
        When checkpoint files exist but none is readable (each one's reason listed), or on
        a rollback, unless ``allow_fresh_start``.
    """
    source = Path(directory)
    mark = _read_mark(source, key, allow_fresh_start) if key is not None else None
    reasons: list[str] = []
    found = None
    for _, path in reversed(_rounds_in(source)):
        try:
            ckpt = load_checkpoint(path, key=key)
            _check_identity(ckpt, path, max_round, None if mark is None else mark.run_id)
            found = (path, ckpt)
            break
        except CheckpointError as err:
            if not skip_corrupt:
                raise
            reasons.append(str(err))
            logger.log(WARNING, "skipping checkpoint %s: %s", path, err)
    if key is not None:
        _check_rollback(source, mark, found, allow_fresh_start)
    if found is not None or not reasons:
        return found
    if allow_fresh_start:
        logger.log(
            WARNING,
            "none of the %d checkpoint(s) in %s is readable; starting from round 0 "
            "(checkpoint-allow-fresh-start = true)",
            len(reasons),
            directory,
        )
        return None
    raise CheckpointError(
        f"none of the {len(reasons)} checkpoint(s) in {directory} is readable, so the run "
        "stops rather than retrain from round 0 over them (set "
        "checkpoint-allow-fresh-start = true to do that): " + "; ".join(reasons)
    )


_FRESH_START_HINT = "set checkpoint-allow-fresh-start = true to go on anyway"


def _read_mark(directory: Path, key: bytes, allow_fresh_start: bool) -> HighWaterMark | None:
    """The directory's high-water mark (None: none, or unreadable and a fresh start allowed)."""
    try:
        return read_mark(directory, key)
    except CheckpointError as err:
        if not allow_fresh_start:
            raise CheckpointError(
                f"{err}: the run stops rather than resume without knowing the newest round "
                f"saved ({_FRESH_START_HINT})"
            ) from err
        logger.log(WARNING, "%s; going on without it (checkpoint-allow-fresh-start = true)", err)
        return None


def _check_identity(
    ckpt: ServerCheckpoint, path: Path, max_round: int | None, run_id: str | None
) -> None:
    """Refuse a round above ``max_round``, or a checkpoint of another run than ``run_id``."""
    if max_round is not None and ckpt.round > max_round:
        raise CheckpointError(
            f"checkpoint {path} holds round {ckpt.round}, beyond the run's {max_round} rounds"
        )
    if run_id is not None and ckpt.run_id != run_id:
        raise CheckpointError(
            f"checkpoint {path} was written by run {ckpt.run_id or '(unknown)'}, the "
            f"directory's high-water mark names run {run_id}"
        )


def _check_rollback(
    directory: Path,
    mark: HighWaterMark | None,
    found: tuple[Path, ServerCheckpoint] | None,
    allow_fresh_start: bool,
) -> None:
    """Refuse (or with ``allow_fresh_start`` log at WARNING) resuming from an older round
    than the high-water ``mark`` records, or from a marked run's checkpoint without a mark."""
    problem = None
    if mark is None:
        if found is not None and found[1].run_id:
            problem = (
                f"{directory} has no high-water mark, but its newest readable checkpoint "
                f"(round {found[1].round}) was written by a run that keeps one: the mark was "
                "deleted, so newer checkpoints may have been deleted too"
            )
    elif found is None and mark.round > 0:
        problem = (
            f"the high-water mark of {directory} records round {mark.round}, but no "
            "checkpoint is readable: a rollback to round 0"
        )
    elif found is not None and found[1].round < mark.round:
        problem = (
            f"the newest readable checkpoint in {directory} is round {found[1].round}, but "
            f"the high-water mark records round {mark.round}: a rollback (a newer checkpoint "
            "was deleted, damaged or replaced by an older one)"
        )
    if problem is None:
        return
    if not allow_fresh_start:
        raise CheckpointError(f"{problem}; the run stops ({_FRESH_START_HINT})")
    resumed = "round 0" if found is None else f"round {found[1].round}"
    logger.log(
        WARNING, "%s; resuming from %s (checkpoint-allow-fresh-start = true)", problem, resumed
    )


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest round checkpoints; return what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    rounds = _rounds_in(Path(directory))
    doomed = [path for _, path in rounds[:-keep]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed
