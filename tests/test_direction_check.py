"""The direction check (fedddl.sync.direction): replies opposed to the others' majority are
left out, honest ones pass unchanged."""

from __future__ import annotations

import pytest
import torch

from fedddl.defenses import Defenses
from fedddl.sync.aggregation import Contribution, running_mean
from fedddl.sync.direction import DirectionCheck, alignments
from fedddl.sync.messages import ClientReply


def _reply(node: int) -> ClientReply:
    return ClientReply(
        node_id=node, model_version=0, fingerprint="", payload=b"", num_examples=1, loss=0.1
    )


def _honest(generator: torch.Generator, truth: torch.Tensor) -> torch.Tensor:
    """A ternary draw of ``truth``: sign(truth) with probability |truth|, else 0."""
    keep = torch.rand(truth.shape, generator=generator) < truth.abs()
    return torch.sign(truth) * keep


def _round(opposed: int = 0, n: int = 10, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    truth = torch.rand(500, generator=generator) * 2 - 1
    grads = [_honest(generator, truth) for _ in range(n)]
    for i in range(opposed):
        grads[i] = -grads[i]
    return grads


def _contributions(
    grads: list[torch.Tensor], shape: tuple[int, ...] = (20, 25)
) -> list[Contribution]:
    return [
        Contribution(_reply(i), {"w": g.reshape(shape).clone()}, scales={"w": 1.0})
        for i, g in enumerate(grads)
    ]


def test_alignment_is_positive_for_honest_and_negative_for_opposed_replies() -> None:
    grads = _round(opposed=1)
    found = alignments([torch.sign(g).to(torch.int8) for g in grads])
    assert found[0] < -0.3
    assert min(found[1:]) > 0.3


def test_alignment_of_an_all_zero_reply_is_zero() -> None:
    grads = _round()
    grads.append(torch.zeros(500))
    assert alignments([torch.sign(g).to(torch.int8) for g in grads])[-1] == 0.0


def test_an_opposed_reply_is_dropped_with_its_reason_and_the_others_pass() -> None:
    check = DirectionCheck(0.5)
    kept = list(check.filter(iter(_contributions(_round(opposed=1)))))
    assert [c.reply.node_id for c in kept] == list(range(1, 10))
    dropped = [v for v in check.verdicts if v.reason]
    assert [v.node_id for v in dropped] == [0]
    assert "direction opposes the round's majority" in dropped[0].reason
    assert "dropped" in dropped[0].reason


def test_three_coordinated_opposed_replies_of_ten_are_all_dropped() -> None:
    check = DirectionCheck(0.5)
    kept = list(check.filter(iter(_contributions(_round(opposed=3)))))
    assert [c.reply.node_id for c in kept] == list(range(3, 10))


def _weak_round(seed: int, n: int = 5, size: int = 20_000) -> list[torch.Tensor]:
    """Honest ternary sign vectors that agree with a shared direction on 51 % of their
    non-zero values (late in training: a direction within noise of none)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.sign(torch.rand(size, generator=generator) - 0.5)
    replies = []
    for _ in range(n):
        keep = torch.rand(size, generator=generator) < 0.3
        same = torch.rand(size, generator=generator) < 0.51
        replies.append(torch.where(same, base, -base) * keep)
    return replies


def test_with_a_noise_margin_replies_within_noise_of_a_weak_median_pass() -> None:
    def drops(noise: float) -> int:
        check = DirectionCheck(0.1, noise=noise)
        found = 0
        for seed in range(40):
            list(check.filter(iter(_contributions(_weak_round(seed), shape=(-1,)))))
            found += sum(bool(v.reason) for v in check.verdicts)
        return found

    assert drops(0.0) >= 5  # without a margin, noise alone drops honest replies
    assert drops(3.0) == 0
    with pytest.raises(ValueError, match="noise"):
        DirectionCheck(0.1, noise=-1.0)


@pytest.mark.parametrize("opposed", [1, 3])
def test_the_noise_margin_still_drops_opposed_replies(opposed: int) -> None:
    check = DirectionCheck(0.5, noise=3.0)
    kept = list(check.filter(iter(_contributions(_round(opposed=opposed)))))
    assert [c.reply.node_id for c in kept] == list(range(opposed, 10))


def test_a_dense_reply_is_dropped_for_its_density_whatever_its_direction() -> None:
    generator = torch.Generator().manual_seed(1)
    grads = [g * (torch.rand(500, generator=generator) < 0.5) for g in _round()]  # ~25 % dense
    grads[0] = torch.ones(500)  # all-plus: every code +1
    check = DirectionCheck(0.1)
    kept = list(check.filter(iter(_contributions(grads))))
    assert [c.reply.node_id for c in kept] == list(range(1, 10))
    assert "500 non-zero values, more than 2 x the round's median" in check.verdicts[0].reason
    lenient = DirectionCheck(0.1, density=0.0)
    list(lenient.filter(iter(_contributions(grads))))
    assert "non-zero values" not in lenient.verdicts[0].reason
    with pytest.raises(ValueError, match="density"):
        DirectionCheck(0.1, density=0.5)


def test_honest_rounds_pass_bit_for_bit() -> None:
    contributions = _contributions(_round())
    want = running_mean(iter(contributions)).gradient["w"]
    check = DirectionCheck(0.5)
    got = running_mean(check.filter(iter(contributions))).gradient["w"]
    assert torch.equal(got, want)
    assert not any(v.reason for v in check.verdicts)


def test_the_check_copies_out_of_a_shared_buffer() -> None:
    buffer = torch.zeros(20, 25)

    def stream():
        for i, g in enumerate(_round()):
            buffer.copy_(g.reshape(20, 25))
            yield Contribution(_reply(i), {"w": buffer}, scales={"w": 1.0})

    got = running_mean(DirectionCheck(0.5).filter(stream())).gradient["w"]
    want = running_mean(iter(_contributions(_round()))).gradient["w"]
    assert torch.equal(got, want)


def test_nothing_is_judged_without_a_majority_direction_or_with_few_replies() -> None:
    # each reply one distinct non-zero value: the others never vote on it, alignments are 0
    lonely = [torch.zeros(500) for _ in range(10)]
    for i, g in enumerate(lonely):
        g[i] = -1.0 if i % 2 else 1.0
    check = DirectionCheck(1.0)
    assert len(list(check.filter(iter(_contributions(lonely))))) == 10
    assert all(v.alignment == 0.0 and not v.reason for v in check.verdicts)
    two = DirectionCheck(0.5)
    assert len(list(two.filter(iter(_contributions(_round(opposed=1, n=2)))))) == 2


def test_off_streams_the_contributions_untouched() -> None:
    contributions = _contributions(_round(opposed=1))
    check = DirectionCheck(0.0)
    assert not check.enabled
    kept = list(check.filter(iter(contributions)))
    assert all(a is b for a, b in zip(kept, contributions, strict=True))
    assert check.verdicts == []


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_bad_fractions_are_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="direction-check"):
        DirectionCheck(fraction)
    with pytest.raises(ValueError, match="direction-check"):
        Defenses(direction_check=fraction)
