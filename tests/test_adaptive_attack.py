"""The adaptive attacker (``adaptive:F``): a gradient negated only on its largest values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedddl.attacks.adaptive import ADAPTIVE_SHARE, adaptive_payload
from fedddl.attacks.spec import Attack, parse_attack
from fedddl.attacks.tamper import tamper_reply
from fedddl.compression import TernaryCompressor, decode_update, encode_update, read_header
from fedddl.sync.direction import alignments, flat_signs
from fedddl.sync.messages import ClientReply


def _honest(seed: int = 0, bucket: int = 0) -> bytes:
    torch.manual_seed(seed)
    grads = {"w": torch.randn(8, 32), "b": torch.randn(4)}
    return encode_update(grads, TernaryCompressor(seed=seed, scale_bucket=bucket), dense=("b",))


def test_adaptive_parses_with_a_factor() -> None:
    assert parse_attack("adaptive:7.9") == Attack("adaptive", 7.9)
    with pytest.raises(ValueError, match="needs an argument"):
        parse_attack("adaptive")


@pytest.mark.parametrize("bucket", [0, 32])
def test_the_largest_share_is_negated_and_every_scale_multiplied(bucket: int) -> None:
    honest = _honest(bucket=bucket)
    forged = adaptive_payload(honest, 7.9, 0.25)
    h, f = decode_update(honest), decode_update(forged)
    hv = torch.cat([h["w"].reshape(-1), h["b"]])
    fv = torch.cat([f["w"].reshape(-1), f["b"]])
    assert torch.equal(hv != 0, fv != 0)  # the same support
    assert torch.allclose(fv.abs(), 7.9 * hv.abs(), rtol=1e-5)
    negated = (torch.sign(hv) * torch.sign(fv)) < 0
    assert int(negated.sum()) == round(0.25 * int((hv != 0).sum()))
    # every negated value is at least as large as every kept one
    assert float(hv.abs()[negated].min()) >= float(hv.abs()[(~negated) & (hv != 0)].max())
    header = {e.name: e for e in read_header(forged)}
    assert header["w"].bucket == bucket and header["w"].codec is not None


def test_a_quarter_negated_still_agrees_with_honest_votes() -> None:
    """Its signs agree with the majority of honest replies more than they disagree (the
    direction check cannot drop it for its direction), unlike a negated gradient."""
    torch.manual_seed(0)
    base = torch.randn(2000)
    signs = []
    for seed in range(9):
        torch.manual_seed(seed + 1)
        grads = {"w": base + 0.8 * torch.randn(2000)}
        signs.append(flat_signs(decode_update(encode_update(grads, TernaryCompressor(seed=seed)))))
    torch.manual_seed(99)
    mine = encode_update({"w": base + 0.8 * torch.randn(2000)}, TernaryCompressor(seed=99))
    forged = flat_signs(decode_update(adaptive_payload(mine, 7.9, ADAPTIVE_SHARE)))
    found = alignments([*signs, forged])
    assert 0 < found[-1] < min(found[:-1])


def test_tamper_reply_runs_the_adaptive_kind() -> None:
    reply = ClientReply(1, 0, "00" * 8, _honest(), 32, 1.0)
    forged = tamper_reply(reply, Attack("adaptive", 7.9))
    assert dataclasses.replace(forged, payload=reply.payload) == reply
    assert forged.payload != reply.payload
