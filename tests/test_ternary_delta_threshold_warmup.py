"""``TernaryDelta(threshold_warmup_rounds=n, warmup_threshold=t)``: the uplink's cut is ``t``
in the first n rounds, the compressor's own afterwards.

In-process (InlineGrid), a tiny model, FedAvg. Checked: the cut reaches the clients in
:data:`META` in exactly those rounds; it changes the reply's codes (a lower cut sends more
non-zero values); off by default (no ``threshold`` key, the codes as before); bad
settings and a bad ``threshold`` key are refused.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedddl.compression import decode_update
from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_protocol import DELTA, DELTA_KEY, META, parse_broadcast
from fedddl.flower.inline_grid import InlineGrid
from fedddl.flower.records import array_to_bytes
from tests.test_flower_ternary_delta import NODES, _client_app, _fedavg, _net


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


#: The threshold ternary compressor whose cut the warm-up replaces (the default before).
CUT = "ternary-projected-base3"


def _run(**options: object) -> tuple[list[tuple[int, float | None]], dict[int, int]]:
    """Three rounds: (round, cut in META) per message; round -> non-zero codes sent up."""
    seen: list[tuple[int, float | None]] = []
    nonzero: dict[int, int] = {}

    def look(message: Message, context: Context) -> None:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        seen.append((rnd, parse_broadcast(message.content).threshold))

    def count(message: Message, reply: Message) -> Message:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        record = reply.content[DELTA]
        assert isinstance(record, ArrayRecord)
        decoded = decode_update(array_to_bytes(record[DELTA_KEY]))
        found = sum(int(t.count_nonzero()) for t in decoded.values())
        nonzero[rnd] = nonzero.get(rnd, 0) + found
        return reply

    grid = InlineGrid(_client_app([ternary_mod]), NODES, before=look, tamper=count)
    strategy = TernaryDelta(
        _fedavg(fraction_evaluate=0.0), error_feedback=False, compressor=CUT,
        **options,  # type: ignore[arg-type]
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=3,
        train_config=ConfigRecord({}),
    )
    assert strategy.dropped == {}
    return seen, nonzero


def test_the_cut_reaches_the_clients_and_changes_the_codes() -> None:
    seen, nonzero = _run(threshold_warmup_rounds=2, warmup_threshold=0.1)
    assert {(r, cut) for r, cut in seen} == {(1, 0.1), (2, 0.1), (3, None)}
    plain_seen, plain_nonzero = _run()
    assert {cut for _, cut in plain_seen} == {None}
    # round 1 starts from the same model: a cut of 0.1 of the scale keeps more values
    assert nonzero[1] > plain_nonzero[1], (nonzero, plain_nonzero)
    assert nonzero[2] > plain_nonzero[2], (nonzero, plain_nonzero)


def test_a_cut_of_one_sends_almost_nothing() -> None:
    _, nonzero = _run(threshold_warmup_rounds=1, warmup_threshold=1.0)
    _, plain = _run()
    assert nonzero[1] < plain[1], (nonzero, plain)


def test_settings_and_meta_are_checked() -> None:
    with pytest.raises(ValueError, match="threshold_warmup_rounds"):
        TernaryDelta(_fedavg(), threshold_warmup_rounds=-1)
    # the default five-level compressor has no cut: a warm-up cut would be ignored, so refused
    with pytest.raises(ValueError, match="threshold_warmup_rounds needs a compressor with a cut"):
        TernaryDelta(_fedavg(), threshold_warmup_rounds=2)
    with pytest.raises(ValueError, match="warmup_threshold"):
        TernaryDelta(_fedavg(), threshold_warmup_rounds=2, warmup_threshold=1.5)
    content = RecordDict({"arrays": ArrayRecord(_net().state_dict())})
    meta = ConfigRecord({
        "record": "arrays", "names": ["a"], "version": 1, "base": -1, "digest": "x",
        "compressor": "ternary-threshold-base3", "clip-sigma": 2.5, "error-feedback": True,
        "seed": 0, "threshold": 1.5,
    })  # fmt: skip
    content[META] = meta
    with pytest.raises(ValueError, match="threshold must be in"):
        parse_broadcast(content)
    meta["threshold"] = 0.25
    assert parse_broadcast(content).threshold == 0.25
