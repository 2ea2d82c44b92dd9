"""The README's plug-in examples run and do what the tested plug-ins do.

The README shows a compressor (``ScaledSign``) and two one-method strategies (``SignGrad``,
``MedianTernGrad``); ``tests/test_strategy_plugins.py`` runs the same classes end to end.
Here the README's own code blocks are executed and compared with those classes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fedddl.compression
from tests import test_strategy_plugins as tested

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block(marker: str) -> str:
    """The README's ``python`` code block that contains ``marker``."""
    blocks = README.read_text(encoding="utf-8").split("```python\n")[1:]
    found = [block.split("```", 1)[0] for block in blocks if marker in block]
    assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}"
    return found[0]


def _run(block: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    registered: dict[str, Any] = {}
    monkeypatch.setattr(
        fedddl.compression,
        "register_compressor",
        lambda name, factory: registered.update({name: factory}),
    )
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(block, str(README), "exec"), namespace)
    namespace["registered"] = registered
    return namespace


def test_readme_compressor_registers_and_matches_the_tested_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ns = _run(_python_block("class ScaledSign"), monkeypatch)
    assert ns["registered"] == {"scaled-sign": ns["ScaledSign"]}
    tensor = torch.linspace(-1.0, 2.0, 37).reshape(37)
    payload, ctx = ns["ScaledSign"]().compress(tensor)
    want, want_ctx = tested.ScaledSign().compress(tensor)
    assert torch.equal(payload.codes, want.codes)
    assert payload.scale == pytest.approx(want.scale)
    assert (payload.numel, payload.codec, ctx) == (want.numel, want.codec, want_ctx)


def test_readme_strategies_match_the_tested_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _run(_python_block("class MedianTernGrad"), monkeypatch)
    assert ns["SignGrad"].compressor_name(None) == "scaled-sign"
    generator = torch.Generator().manual_seed(0)
    contributions = [
        SimpleNamespace(
            reply=f"reply-{i}",
            gradient={
                "w": torch.randn(3, 4, generator=generator),
                "b": torch.randn(4, generator=generator),
            },
        )
        for i in range(5)
    ]
    got = ns["MedianTernGrad"].aggregate_gradients(None, contributions)
    want = tested.MedianTernGrad.aggregate_gradients(None, contributions)
    assert got.contributors == want.contributors == [f"reply-{i}" for i in range(5)]
    assert set(got.gradient) == set(want.gradient) == {"w", "b"}
    for name in want.gradient:
        assert torch.equal(got.gradient[name], want.gradient[name])
