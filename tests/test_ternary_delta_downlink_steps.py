"""``TernaryDelta(downlink_steps=k)``: k ternary deltas towards each new global model;
``TernaryDelta(feedback_warmup_rounds=n)``: no uplink error feedback in the first n rounds;
``TernaryDelta(feedback_until_round=n)``: none after round n.

In-process (InlineGrid), a tiny model, FedAvg. Checked: the clients apply every step and
hold the server's broadcast model bit for bit; each new global model adds k versions; the
broadcast model ends closer to the exact global model than with one step; one step is
the default and sends what it sent before.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from fedddl.flower import TernaryDelta, ternary_mod
from fedddl.flower.delta_mod import STATE_RESIDUAL
from fedddl.flower.delta_protocol import UPDATES, parse_broadcast, split_model
from fedddl.flower.inline_grid import InlineGrid
from tests.test_flower_ternary_delta import NODES, _client_app, _fedavg, _held, _net


def _run(steps: int) -> tuple[TernaryDelta, InlineGrid, list[int], float]:
    """Three rounds; the number of updates in each delta message; the final gap."""
    counts: list[int] = []

    def look(message: Message, context: Context) -> None:
        updates = message.content.get(UPDATES)
        if isinstance(updates, ArrayRecord):
            counts.append(len(updates))

    grid = InlineGrid(_client_app([ternary_mod]), NODES, before=look)
    strategy = TernaryDelta(_fedavg(fraction_evaluate=1.0), downlink="delta", downlink_steps=steps)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=3,
        train_config=ConfigRecord({}),
        evaluate_fn=lambda r, a: MetricRecord({"ok": 1}),
    )
    assert result.arrays is not None and strategy.dropped == {}
    exact = split_model(result.arrays).floats
    held = split_model(strategy.broadcast_model()).floats  # type: ignore[arg-type]
    gap = float(torch.cat([(exact[n] - held[n]).reshape(-1) for n in exact]).norm())
    return strategy, grid, counts, gap


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_every_step_is_applied_and_the_gap_shrinks() -> None:
    one, _, counts_one, gap_one = _run(1)
    two, grid, counts_two, gap_two = _run(2)
    # 4 global models broadcast: the initial one and the first aggregate whole (FedAvg turns
    # the integer buffer into float64: a new layout), then 2 aggregates: 2 + 2k versions
    assert (one.version, two.version) == (4, 6)
    # a node that holds the last version gets no update, one that holds the one before gets k
    assert set(counts_one) == {0, 1} and set(counts_two) == {0, 2}
    assert gap_two < 0.6 * gap_one, (gap_one, gap_two)
    server = split_model(two.broadcast_model()).floats  # type: ignore[arg-type]
    for context in grid.contexts.values():
        held = _held(context)
        assert all(torch.equal(held[n], server[n]) for n in server)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="downlink_steps"):
        TernaryDelta(_fedavg(), downlink_steps=0)
    with pytest.raises(ValueError, match="delta downlink only"):
        TernaryDelta(_fedavg(), downlink="grid", downlink_steps=2)


def _feedback_seen(**settings: int) -> tuple[InlineGrid, list[tuple[int, bool, bool]]]:
    """Four rounds of ``TernaryDelta(FedAvg, **settings)``; per message: its round, whether it
    asks for error feedback, whether the node held a residual when it arrived."""
    seen: list[tuple[int, bool, bool]] = []

    def look(message: Message, context: Context) -> None:
        rnd = int(message.content["config"]["server-round"])  # type: ignore[index, arg-type]
        broadcast = parse_broadcast(message.content)
        seen.append((rnd, broadcast.error_feedback, STATE_RESIDUAL in context.state))

    grid = InlineGrid(_client_app([ternary_mod]), NODES, before=look)
    strategy = TernaryDelta(_fedavg(fraction_evaluate=0.0), **settings)  # type: ignore[arg-type]
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_net().state_dict()),
        num_rounds=4,
        train_config=ConfigRecord({}),
    )
    assert strategy.dropped == {}
    return grid, seen


def test_feedback_warmup_rounds_send_the_first_replies_without_residuals() -> None:
    _, seen = _feedback_seen(feedback_warmup_rounds=2)
    assert {(r, feedback) for r, feedback, _ in seen} == {
        (1, False), (2, False), (3, True), (4, True)
    }  # fmt: skip
    # no residual is kept before round 3's replies; round 4 finds the one of round 3
    assert {r: held for r, _, held in seen} == {1: False, 2: False, 3: False, 4: True}
    with pytest.raises(ValueError, match="feedback_warmup_rounds"):
        TernaryDelta(_fedavg(), feedback_warmup_rounds=-1)


def test_feedback_ends_after_feedback_until_round_and_the_residual_is_dropped() -> None:
    grid, seen = _feedback_seen(feedback_until_round=2)
    assert {(r, feedback) for r, feedback, _ in seen} == {
        (1, True), (2, True), (3, False), (4, False)
    }  # fmt: skip
    # round 3 still finds round 2's residual; its reply drops it, so round 4 finds none
    assert {r: held for r, _, held in seen} == {1: False, 2: True, 3: True, 4: False}
    assert all(STATE_RESIDUAL not in context.state for context in grid.contexts.values())
    with pytest.raises(ValueError, match="feedback_until_round"):
        TernaryDelta(_fedavg(), feedback_until_round=-1)
    with pytest.raises(ValueError, match="would apply to no round"):
        TernaryDelta(_fedavg(), feedback_warmup_rounds=30)  # the window ends at round 20
    TernaryDelta(_fedavg(), feedback_warmup_rounds=30, feedback_until_round=0)
    TernaryDelta(_fedavg(), feedback_warmup_rounds=30, error_feedback=False)


def test_feedback_window() -> None:
    from fedddl.flower.error_feedback_choice import FeedbackWindow

    window = FeedbackWindow(True, "auto", 1, 3)
    assert [window.applies(r) for r in range(1, 6)] == [False, True, True, False, False]
    assert str(window) == "True (auto), rounds 2-3"
    to_the_end = FeedbackWindow(True)
    assert all(to_the_end.applies(r) for r in (1, 50, 10_000))
    assert str(to_the_end) == "True (set), rounds 1-end"
    off = FeedbackWindow(False, "auto: FedMedian does not average every reply", 30, 20)
    assert not any(off.applies(r) for r in range(1, 40)) and str(off).startswith("False (auto:")
    with pytest.raises(ValueError, match="would apply to no round"):
        FeedbackWindow(True, "set", 3, 3)
