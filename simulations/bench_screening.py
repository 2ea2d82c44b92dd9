"""Expected shape first: what a hostile 65,536-tensor reply costs the server, side by side.

Prints, for the ``many-tensors`` attack payload (a valid 1.56 MB message of 65,536
one-element ternary tensors) and an honest digits-MLP reply, the time of the server's
header screening (:class:`fedddl.sync.screening.PayloadSpec`) and of a full
``decode_update`` (what the server did first before the screening existed), and the peak
memory each allocates (``tracemalloc``)::

    python -m simulations.bench_screening
"""

from __future__ import annotations

import contextlib
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch

from fedddl.app_config import AppConfig
from fedddl.attacks.tamper import many_tensors_payload
from fedddl.compression import TernaryCompressor, decode_update, encode_update, get_compressor
from fedddl.sync.screening import PayloadSpec


def _measure(work: Callable[[], Any], repeats: int) -> tuple[float, int]:
    """Best seconds of ``repeats`` calls, and the peak bytes allocated by one."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    tracemalloc.start()
    try:
        work()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return best, peak


def main() -> None:
    """Print the table."""
    torch.set_num_threads(1)
    model = AppConfig().model_factory()()
    spec = PayloadSpec.for_model(model, get_compressor("ternary-base3"))
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    honest = encode_update(grads, TernaryCompressor(seed=0, codec="base3"))
    hostile = many_tensors_payload()

    def screen(payload: bytes) -> None:
        with contextlib.suppress(ValueError):  # the hostile one is rejected
            spec.check(payload, 0)

    print("| payload | bytes | screening s | screening peak B | decode s | decode peak B | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, payload, repeats in (("honest", honest, 20), ("many-tensors", hostile, 2)):
        s_time, s_peak = _measure(lambda p=payload: screen(p), repeats)
        d_time, d_peak = _measure(lambda p=payload: decode_update(p), repeats)
        print(
            f"| {name} | {len(payload):,} | {s_time:.2e} | {s_peak:,} | {d_time:.2e} "
            f"| {d_peak:,} | {d_time / s_time:,.0f}x |"
        )


if __name__ == "__main__":
    main()
