"""``GridFollower`` (server) and ``grid_holder`` (client): a model on the integer grid that
follows targets, and holders that reach it bit for bit from any version, from nothing, and
across a rebase; the quantizer's exponent floors."""

from __future__ import annotations

import pytest
import torch

from fedddl.sync.grid import GridError
from fedddl.sync.grid_follower import GridFollower
from fedddl.sync.grid_holder import load_state, reach, state_counts
from fedddl.sync.grid_quantizer import GridQuantizer
from fedddl.training import tensors_fingerprint


def _targets(count: int, scale: float = 0.01) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(32, 32, generator=g) * 0.1, "b": torch.zeros(32)}
    out = []
    for _ in range(count):
        model = {n: t + torch.randn(t.shape, generator=g) * scale for n, t in model.items()}
        out.append(model)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return tensors_fingerprint(a) == tensors_fingerprint(b)


def test_holders_reach_the_follower_bit_for_bit_from_any_version() -> None:
    follower = GridFollower(levels=1, log_size=6)
    states = {}
    for target in _targets(12):
        follower.follow(target)
        states[follower.version] = follower.state.copy()  # type: ignore[union-attr]
    layout = follower.layout
    for known in (-1, 0, 1, 3, 6, 11, 12):
        base, data = follower.catch_up(known)
        held = states.get(base)
        state = reach(held, base if held else None, base, data, layout, follower.version)
        assert _same(state.values(), follower.values()), known
    # beyond the log (6 versions) or unknown: the counts from zero, smaller than fp32
    assert follower.catch_up(3)[0] == 0 and follower.catch_up(-1)[0] == 0
    fp32 = 4 * sum(t.numel() for t in follower.values().values())
    assert len(follower.catch_up(-1)[1]) < fp32 / 2
    # within the log: from the version held, and the message grows slowly with the gap
    near, far = follower.catch_up(11), follower.catch_up(7)
    assert near[0] == 11 and far[0] == 7 and len(near[1]) < len(far[1]) < 4 * len(near[1])


def test_the_follower_tracks_its_targets_without_drift() -> None:
    follower = GridFollower(levels=1, log_size=4)
    gaps = []
    for target in _targets(40):
        follower.follow(target)
        values = follower.values()
        gaps.append(max(float((target[n] - values[n]).abs().max()) for n in target))
    assert max(gaps[20:]) <= 2 * max(gaps[:20])  # error feedback: the gap does not grow
    assert gaps[-1] < 0.1


def test_a_rebase_is_carried_by_anchors() -> None:
    follower = GridFollower(levels=1, log_size=4)
    target = {"w": torch.full((8,), 1.0)}
    follower.follow(target)
    for step in range(3):  # tiny steps refine the unit far below the values
        target = {"w": target["w"] + 1e-6 * (step + 1)}
        follower.follow(target)
    old = follower.version
    held = follower.state.copy()  # type: ignore[union-attr]
    follower.follow({"w": torch.full((8,), 4096.0)})  # the counts would overflow
    assert follower.rebased
    base, data = follower.catch_up(-1)
    assert base == -1  # from zero no longer works: the anchors travel too
    anchors = follower.anchors()
    state = reach(None, None, -1, data, follower.layout, follower.version, anchors)
    assert _same(state.values(), follower.values())
    with pytest.raises(GridError, match="anchors"):
        reach(None, None, -1, data, follower.layout, follower.version, None)
    base, data = follower.catch_up(old)  # a rebase segment within the log
    assert base == old
    state = reach(held, old, base, data, follower.layout, follower.version)
    assert _same(state.values(), follower.values())


def test_a_holder_refuses_what_it_cannot_apply() -> None:
    follower = GridFollower(levels=1, log_size=4)
    for target in _targets(3):
        follower.follow(target)
    base, data = follower.catch_up(2)
    with pytest.raises(GridError, match="starts from version 2"):
        reach(None, None, base, data, follower.layout, follower.version)
    zero = reach(None, None, 0, follower.catch_up(-1)[1], follower.layout, follower.version)
    with pytest.raises(GridError, match="expected 2 to 4"):
        reach(zero, 2, 2, data, follower.layout, 4)
    with pytest.raises(GridError):
        reach(zero, 2, 2, data[:-3], follower.layout, follower.version)


def test_a_state_is_kept_as_anchors_and_counts() -> None:
    follower = GridFollower(levels=2, log_size=4)
    for target in _targets(5):
        follower.follow(target)
    state = follower.state
    assert state is not None
    again, version = load_state(state.anchors(), state_counts(state, follower.version))
    assert version == follower.version and _same(again.values(), state.values())
    assert again.units() == state.units()


def test_a_follower_refuses_targets_it_cannot_take() -> None:
    follower = GridFollower()
    with pytest.raises(ValueError, match="not finite"):
        follower.follow({"w": torch.tensor([float("nan")])})
    follower.follow({"w": torch.ones(3)})
    with pytest.raises(ValueError, match="not the grid's"):
        follower.follow({"w": torch.ones(4)})
    with pytest.raises(ValueError):
        follower.follow({"w": torch.full((3,), 3e38)})
    assert follower.version == 1  # nothing changed
    assert follower.catch_up(1)[0] == 1


def test_the_quantizer_floors_the_exponent() -> None:
    tiny = {"w": torch.full((4,), 1e-12)}
    assert GridQuantizer(1, 0).quantize(1, tiny).units["w"] < -30
    floored = GridQuantizer(1, 0).quantize(1, tiny, floors={"w": -10})
    assert floored.units["w"] == -10
    zero = GridQuantizer(1, 0).quantize(1, {"w": torch.zeros(4)}, floors={"w": -7})
    assert zero.units["w"] == -7


def test_the_quantizer_rounds_to_nearest_when_asked() -> None:
    step = {"w": torch.tensor([0.4, 0.6, -0.6, 1.0, -0.1])}
    nearest = GridQuantizer(1, 0, stochastic=False).quantize(1, step)
    assert nearest.units["w"] == 0 and nearest.deltas["w"].tolist() == [0, 1, -1, 1, 0]
