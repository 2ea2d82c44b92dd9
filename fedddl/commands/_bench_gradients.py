"""Message sizes of every ternary codec on real gradients (part of ``fedddl bench compression``).

Models are given as ``dataset:arch`` pairs (any dataset of :mod:`fedddl.data` and any
architecture of :func:`fedddl.models.create_model`); each is trained for ``steps`` SGD
steps on its dataset, then the gradient of one more batch of 32 is encoded.  Two small
models on scikit-learn's digits (``mlp 64-128-10``, ``cnn 2 conv + fc``) are always
measured too.  A dataset that is not installed skips its models, with a note.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

__all__ = ["DEFAULT_MODELS", "gradient_sizes", "parse_models"]

#: The default ``--gradient-models``.
DEFAULT_MODELS = "digits:mlp,fashion-mnist:cnn"
_BATCH = 32


def parse_models(text: str) -> list[tuple[str, str]]:
    """``"digits:mlp,fashion-mnist:cnn"`` -> ``[("digits", "mlp"), ...]``.

    Raises
    ------
    ValueError
        If an item is not ``dataset:arch``.
    """
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        dataset, sep, arch = item.partition(":")
        if not sep or not dataset or not arch:
            raise ValueError(f"expected dataset:arch, got {item!r}")
        pairs.append((dataset, arch))
    return pairs


def _builtin_gradients(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Gradients of the two small digits models at random init (one batch of 32)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    torch.manual_seed(seed)
    models = {
        "mlp 64-128-10": (
            torch.nn.Sequential(
                torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
            ),
            x,
        ),
        "cnn 2 conv + fc": (
            torch.nn.Sequential(
                torch.nn.Conv2d(1, 16, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Conv2d(16, 32, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Flatten(),
                torch.nn.Linear(32 * 64, 10),
            ),
            x.view(-1, 1, 8, 8),
        ),
    }
    result = {}
    for name, (model, inputs) in models.items():
        batch = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:_BATCH]
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs[batch]), y[batch])
        loss.backward()  # type: ignore[no-untyped-call]
        result[name] = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
    return result


def _model_gradients(dataset: str, arch: str, steps: int, seed: int) -> dict[str, torch.Tensor]:
    """The gradient of one batch after ``steps`` SGD steps (lr 0.05, momentum 0.9)."""
    from fedddl.data import load_dataset
    from fedddl.models import create_model
    from fedddl.training import compute_gradients, named_gradients

    data = load_dataset(dataset)
    model = create_model(dataset, seed=seed, arch=arch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps + 1):
        index = torch.randint(len(data), (_BATCH,), generator=generator).tolist()
        x = torch.stack([data[i][0] for i in index])
        y = torch.tensor([int(data[i][1]) for i in index])
        compute_gradients(model, x, y)
        if step < steps:
            optimizer.step()
    return named_gradients(model)


def _row(model: str, grads: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
    from fedddl.compression import (
        TernaryCompressor,
        TernaryEntropyCompressor,
        decode_update,
        encode_update,
    )
    from fedddl.compression.backends.packing import packed_size

    numel = sum(g.numel() for g in grads.values())
    two_bit = encode_update(grads, TernaryCompressor(seed=seed))
    base3 = encode_update(grads, TernaryCompressor(seed=seed, codec="base3"))
    entropy = encode_update(grads, TernaryEntropyCompressor(seed=seed))
    decoded = decode_update(base3)
    if decode_update(entropy).keys() != decoded.keys() or not all(
        torch.equal(decoded[n], t) for n, t in decode_update(entropy).items()
    ):
        raise AssertionError(f"{model}: ternary-entropy does not decode to the base-3 values")
    zeros = sum(int((t == 0).sum()) for t in decoded.values()) / max(numel, 1)
    p_nonzero = (1 - zeros) / 2
    entropy_bits = -sum(p * math.log2(p) for p in (zeros, p_nonzero, p_nonzero) if p > 0)
    # order-0 bound: each tensor's codes at their own empirical entropy, plus the headers
    bound_bits = 0.0
    for tensor in decoded.values():
        counts = [int((tensor == 0).sum()), int((tensor > 0).sum()), int((tensor < 0).sum())]
        total = sum(counts)
        bound_bits -= sum(c * math.log2(c / total) for c in counts if c)
    headers = len(base3) - sum(packed_size(t.numel(), "base3") for t in decoded.values())
    return {
        "model": model,
        "params": numel,
        "fp32_bytes": 4 * numel,
        "2bit_bytes": len(two_bit),
        "base3_bytes": len(base3),
        "entropy_bytes": len(entropy),
        "entropy_vs_base3": len(entropy) / len(base3),
        "order0_bound_vs_base3": (bound_bits / 8 + headers) / len(base3),
        "zlib9_2bit_bytes": len(zlib.compress(two_bit, 9)),
        "zlib9_base3_bytes": len(zlib.compress(base3, 9)),
        "zero_fraction": zeros,
        "entropy_bits_per_value": entropy_bits,
    }


def gradient_sizes(
    models: list[tuple[str, str]], steps: int, seed: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of message sizes (the two built-in digits models, then ``models``) and notes
    on the models that were skipped."""
    from fedddl.data import DatasetNotFoundError

    rows = [_row(name, grads, seed) for name, grads in _builtin_gradients(seed).items()]
    notes = []
    for dataset, arch in models:
        try:
            grads = _model_gradients(dataset, arch, steps, seed)
        except DatasetNotFoundError as error:
            notes.append(f"{dataset}:{arch} skipped: {error}")
            continue
        rows.append(_row(f"{dataset}:{arch} @{steps}", grads, seed))
    return rows, notes
