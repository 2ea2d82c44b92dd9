"""The error raised when dataset files are not on disk."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["DatasetNotFoundError", "missing_files_error"]


class DatasetNotFoundError(FileNotFoundError):
    """Dataset files are missing; the message says where to put them."""


def missing_files_error(
    name: str, searched: Sequence[Path], expected: Sequence[str], can_download: bool = True
) -> DatasetNotFoundError:
    """Build a :class:`DatasetNotFoundError` naming the searched places and the fix.

    Parameters
    ----------
    name : str
        Dataset name.
    searched : sequence of Path
        Directories (or files) that were looked at, first one preferred.
    expected : sequence of str
        File names expected in such a directory.
    can_download : bool
        Whether ``download=True`` is offered as a remedy.
    """
    places = "\n".join(f"  - {p}" for p in searched)
    files = ", ".join(expected)
    remedy = (
        f"Put the files in {searched[0]} or pass download=True to fetch them."
        if can_download
        else f"Put the files in {searched[0]}."
    )
    return DatasetNotFoundError(
        f"{name}: dataset files not found. Looked in:\n{places}\nExpected: {files}\n{remedy}"
    )
