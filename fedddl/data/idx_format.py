"""Reader for the IDX format of MNIST / Fashion-MNIST (plain or gzip-compressed)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

__all__ = ["read_idx"]

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/).
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (``.gz`` is decompressed transparently) into a numpy array.

    Parameters
    ----------
    path : str or PathLike
        File to read.

    Returns
    -------
    numpy.ndarray
        Array with the shape and dtype (native byte order) stored in the file.

    Raises
    ------
    ValueError
        If the header is malformed or the payload size does not match it.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{type_code:02x}")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_len != expected:
        raise ValueError(
            f"{path}: IDX payload has {len(raw) - header_len} bytes, header {shape} "
            f"implies {expected}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=False)
