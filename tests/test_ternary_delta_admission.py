"""Hostile replies to ``TernaryDelta``, built byte by byte, on the inline engine: each is
refused (or clipped) with its reason, the round completes with the honest clients, the
global model stays finite and the server never raises."""

from __future__ import annotations

import logging
import math
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedddl.compression import OpenedMessage
from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_admission import DeltaAdmission
from fedddl.flower.delta_protocol import DELTA, DELTA_KEY, META
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.records import array_to_bytes, bytes_to_array
from fedddl.sync.messages import ClientReply
from fedddl.sync.report import RoundReport
from fedddl.sync.scale_bound import ScaleBound
from tests.test_flower_ternary_delta import NODES, _client_app, _fedavg, _net, _run

VICTIM = 1001


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


# ------------------------------------------------------------------ byte-level messages
def _entries(data: bytes) -> list[tuple[int, int]]:
    """(offset of the f32 scale or -1, kind) of every entry of an FDTQ message."""
    count = struct.unpack_from("<I", data, 6)[0]
    at, out = 18, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, at)
        at += 2 + length
        _, kind, ndim = struct.unpack_from("<BBB", data, at)
        at += 3 + 8 * ndim
        out.append((at if kind else -1, kind))
        at += 4 if kind else 0
    return out


def _sealed(body: bytes) -> bytes:
    """``body`` (prefix to data, no CRC) with its length field and CRC made valid."""
    raw = bytearray(body)
    struct.pack_into("<Q", raw, 10, len(raw) + 4)
    return bytes(raw) + struct.pack("<I", zlib.crc32(bytes(raw)))


def _with_scale(scale: float) -> Callable[[bytes], bytes]:
    def change(data: bytes) -> bytes:
        raw = bytearray(data[:-4])
        for offset, kind in _entries(data):
            if kind:
                struct.pack_into("<f", raw, offset, scale)
        return _sealed(bytes(raw))

    return change


def _many_tensors(data: bytes) -> bytes:
    """65,536 one-element float32 tensors: a 1.5 MB message."""
    count = 1 << 16
    parts = [struct.pack("<4sBBIQ", b"FDTQ", 1, 0, count, 0)]
    for i in range(count):
        name = f"t{i}".encode()
        parts.append(struct.pack("<H", len(name)) + name + struct.pack("<BBBQ", 1, 0, 1, 1))
    parts.append(b"\0\0\0\0" * count)
    return _sealed(b"".join(parts))


def _wrong_shape(data: bytes) -> bytes:
    """The first weight matrix declared (6, 16) instead of (16, 6): same size, same bytes."""
    raw = bytearray(data[:-4])
    (length,) = struct.unpack_from("<H", raw, 18)
    at = 18 + 2 + length + 3
    assert struct.unpack_from("<QQ", raw, at) == (16, 6)
    struct.pack_into("<QQ", raw, at, 6, 16)
    return _sealed(bytes(raw))


def _tamper(change: Callable[[RecordDict], None], rounds: set[int]) -> Any:
    def tamper(message: Message, reply: Message) -> Message:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        if (
            message.metadata.dst_node_id == VICTIM
            and message.metadata.message_type == "train"
            and rnd in rounds
            and not reply.has_error()
        ):
            change(reply.content)
        return reply

    return tamper


def _payload(change: Callable[[bytes], bytes]) -> Callable[[RecordDict], None]:
    def rewrite(content: RecordDict) -> None:
        data = array_to_bytes(content[DELTA][DELTA_KEY])  # type: ignore[index, arg-type]
        content[DELTA] = ArrayRecord({DELTA_KEY: bytes_to_array(change(data))})  # type: ignore[arg-type]

    return rewrite


def _nan_plain(content: RecordDict) -> None:
    """A plain reply (no mod records) whose weights are NaN."""
    for key in (META, DELTA):
        del content[key]
    state = {k: torch.full_like(v, math.nan) if v.is_floating_point() else v
             for k, v in _net().state_dict().items()}  # fmt: skip
    content["arrays"] = ArrayRecord(state)


def _finite(arrays: ArrayRecord) -> bool:
    return all(
        bool(np.isfinite(a.numpy()).all()) for a in arrays.values() if a.numpy().dtype.kind == "f"
    )


def _attack(
    change: Callable[[RecordDict], None], rounds: set[int], **settings: Any
) -> tuple[TernaryDelta, Any, list[ArrayRecord], InlineGrid]:
    grid = InlineGrid(_client_app([ternary_mod]), NODES, tamper=_tamper(change, rounds))
    strategy = TernaryDelta(_fedavg(), **settings)
    result, seen = _run(grid, strategy, rounds=3)
    return strategy, result, seen, grid


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("scale", [1e6, 1e30, 1.7e38])
def test_a_huge_scale_is_dropped(scale: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(_payload(_with_scale(scale)), {1, 2, 3})
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert strategy.dropped == {"PayloadRejected": 3} and strategy.clipped == {}
    assert not strategy.skipped and len(result.train_metrics_clientapp) == 3
    messages = [r.getMessage() for r in caplog.records]
    dropped = [m for m in messages if f"TernaryDelta dropped the reply of node {VICTIM}" in m]
    assert len(dropped) == 3 and all("exceeds the bound" in m for m in dropped), messages


def test_a_five_level_scale_past_float32_is_a_malformed_reply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """3e38 x level 2 is not a float32: the message itself is refused, before any bound."""
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(_payload(_with_scale(3e38)), {1, 2, 3})
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert strategy.dropped == {"PayloadError": 3} and strategy.clipped == {}
    messages = [r.getMessage() for r in caplog.records]
    dropped = [m for m in messages if f"TernaryDelta dropped the reply of node {VICTIM}" in m]
    assert len(dropped) == 3 and all("past float32" in m for m in dropped), messages


def test_a_huge_scale_is_clipped_to_the_bound_with_action_clip(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(
            _payload(_with_scale(1.7e38)), {1, 2, 3}, scale_bound_action="clip"
        )
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert strategy.clipped[VICTIM] == 3 and strategy.dropped == {} and not strategy.skipped
    clipped = [r.getMessage() for r in caplog.records if "clipping reply" in r.getMessage()]
    assert clipped and all(f"node {VICTIM}" in m and "exceeds the bound" in m for m in clipped)
    # the bound holds the attacker to 8 x the honest median: the model moves little
    start = ArrayRecord(_net().state_dict())
    step = max(
        float(np.abs(result.arrays[n].numpy() - start[n].numpy()).max())
        for n in start
        if start[n].numpy().dtype.kind == "f"
    )
    assert step < 10.0, step


def test_without_the_bound_a_huge_model_is_adopted_but_nothing_non_finite(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(
            _payload(_with_scale(3e38)), {2}, scale_bound=0, downlink="delta",
            compressor="ternary-projected-base3",  # five levels: 3e38 is refused (below)
        )
    # the round-2 aggregate is finite but huge (3e38 / 4); the clients' next models are
    # not: their mods cannot encode them and send them plain, and the plain replies'
    # admission drops them for their non-finite values; every adopted model is finite
    assert result.arrays is not None and all(_finite(a) for a in seen)
    messages = [r.getMessage() for r in caplog.records]
    assert any("its delta cannot be encoded" in m for m in messages), messages
    dropped = [m for m in messages if "TernaryDelta dropped the reply" in m]
    assert dropped and all("holds non-finite values" in m for m in dropped), dropped
    assert strategy.dropped == {"PayloadRejected": len(dropped)}


def test_a_non_finite_aggregate_is_not_adopted(caplog: pytest.LogCaptureFixture) -> None:
    class Overflow(FedAvg):
        """FedAvg whose round-2 aggregate is not finite."""

        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            arrays, metrics = super().aggregate_train(server_round, replies)
            if server_round == 2 and arrays is not None:
                weight = arrays["0.weight"].numpy().copy()
                weight[0, 0] = math.inf
                arrays["0.weight"] = Array(weight)
            return arrays, metrics

    grid = InlineGrid(_client_app([ternary_mod]), NODES)
    strategy = TernaryDelta(Overflow(fraction_train=1.0, fraction_evaluate=0.5,
                                     min_available_nodes=NODES))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        result, seen = _run(grid, strategy, rounds=3)
    assert strategy.skipped == [2] and all(_finite(a) for a in seen)
    assert any("skipped round 2" in r.getMessage() for r in caplog.records)
    assert len(result.train_metrics_clientapp) == 3 and strategy.dropped == {}


def test_a_nan_plain_reply_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(_nan_plain, {2})
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert sum(strategy.dropped.values()) == 1 and not strategy.skipped
    messages = [r.getMessage() for r in caplog.records]
    dropped = [m for m in messages if f"TernaryDelta dropped the reply of node {VICTIM}" in m]
    assert dropped and "non-finite" in dropped[0], messages
    assert len(result.train_metrics_clientapp) == 3


def test_a_reply_of_65536_tensors_is_refused_before_decoding(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    decoded: list[int] = []
    original = OpenedMessage.decode

    def decode(self: OpenedMessage, out: Any = None) -> dict[str, torch.Tensor]:
        decoded.append(len(self.entries))
        return original(self, out)

    monkeypatch.setattr(OpenedMessage, "decode", decode)
    timings: list[float] = []
    original_incoming = TernaryDelta._incoming

    def incoming(self: TernaryDelta, server_round: int, replies: Any) -> list[Message]:
        started = time.perf_counter()
        out = original_incoming(self, server_round, replies)
        timings.append(time.perf_counter() - started)
        return out

    monkeypatch.setattr(TernaryDelta, "_incoming", incoming)
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(_payload(_many_tensors), {2})
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert sum(strategy.dropped.values()) == 1
    assert (1 << 16) not in decoded and max(timings) < 1.0, timings
    messages = [r.getMessage() for r in caplog.records]
    dropped = [m for m in messages if f"TernaryDelta dropped the reply of node {VICTIM}" in m]
    assert dropped and "exceeds the limit" in dropped[0], messages


def test_a_reply_of_wrong_shapes_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        strategy, result, seen, _ = _attack(_payload(_wrong_shape), {2})
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert sum(strategy.dropped.values()) == 1
    messages = [r.getMessage() for r in caplog.records]
    dropped = [m for m in messages if f"TernaryDelta dropped the reply of node {VICTIM}" in m]
    assert dropped and "has shape (6, 16)" in dropped[0], messages


def test_a_plain_reply_of_another_layout_is_refused() -> None:
    def other_layout(content: RecordDict) -> None:
        for key in (META, DELTA):
            del content[key]
        content["arrays"] = ArrayRecord({"x": Array(np.zeros(3, dtype=np.float32))})

    strategy, result, seen, _ = _attack(other_layout, {1})
    assert result.arrays is not None and all(_finite(a) for a in seen)
    assert sum(strategy.dropped.values()) == 1
    assert isinstance(result.train_metrics_clientapp[1], MetricRecord)


def test_a_reply_of_65536_tensors_under_the_size_limit_is_refused_from_its_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For a model large enough that 1.5 MB is a plausible reply, the tensor count refuses
    it before any entry is parsed."""
    decoded: list[int] = []
    monkeypatch.setattr(OpenedMessage, "decode", lambda self, out=None: decoded.append(1))
    admission = DeltaAdmission(ScaleBound())
    floats = {"w": torch.zeros(1000, 1000), "b": torch.zeros(1000)}
    admission.nodes.sent(VICTIM, 1, "ternary-threshold-base3")
    payload = _many_tensors(b"")
    report = RoundReport(1)
    started = time.perf_counter()
    admitted = list(
        admission.admit(
            [ClientReply(VICTIM, 1, "", payload, 0, math.nan)],
            floats, 1, "ternary-threshold-base3", 2.5, report,
        )
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    assert admitted == [] and not decoded and elapsed < 1.0, elapsed
    assert len(payload) > 1_400_000 and "65536 tensors" in report.dropped[VICTIM], report.dropped
    assert admission.held(VICTIM) == -1  # it gets the whole model next time
