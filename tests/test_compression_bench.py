"""``fedddl bench compression`` runs and reports every case (tiny sizes)."""

from __future__ import annotations

import argparse
import json

import pytest

from fedddl.commands import bench
from fedddl.commands._bench_gradients import parse_models


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(
        [
            *("compression", "--numel", "10001", "--repeats", "1", "--json"),
            *("--shapes", "flat", "--gradient-models", "digits:mlp"),
        ]
    )
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    (run,) = report["runs"]
    assert run["shapes"] == "flat" and run["numel"] == 10001
    cases = {row["case"]: row for row in run["throughput"]}
    for name in (
        "memory copy, new tensor (clone)",
        "memory copy, warm buffer (copy_)",
        "naive: torch.rand ternarize + pack",
        "GRACE TernGrad compress (clip, uniform_, int8)",
        "GRACE TernGrad decompress (int8 x s, new)",
        "decode_update ternary 2-bit, out=warm",
        "decode_update ternary base-3, out=warm",
        "decode_update ternary-entropy, out=warm",
        "decode_update identity fp32, out=warm",
        "encode_update identity fp32, into=warm",
        "encode_update ternary base-3, into=warm",
    ):
        assert name in cases
    two_bit = cases["encode_update ternary 2-bit"]
    assert two_bit["message_bytes"] == 18 + 2 + 6 + 3 + 8 + 4 + 4 + 2501
    assert two_bit["reference"].startswith("GRACE TernGrad compress")
    assert cases["decode_update ternary base-3"]["reference"].startswith("GRACE TernGrad decomp")
    assert cases["encode_update identity fp32"]["reference"] == "memory copy, warm buffer (copy_)"
    into = cases["encode_update identity fp32, into=warm"]
    assert into["reference"] == "memory copy, warm buffer (copy_)"
    assert into["message_bytes"] == cases["encode_update identity fp32"]["message_bytes"]
    # random normal values: entropy coding saves little, but never costs
    entropy = cases["encode_update ternary-entropy"]["message_bytes"]
    assert entropy <= cases["encode_update ternary base-3"]["message_bytes"]
    assert all(row["gb_per_s"] > 0 for row in run["throughput"])
    assert all(row["x_reference"] > 0 for row in run["throughput"] if row["reference"])
    for row in report["gradient_sizes"]:
        # not quite 16x: the headers of the small bias tensors cost a little
        assert row["base3_bytes"] < row["2bit_bytes"] < row["fp32_bytes"] / 14
        assert row["entropy_bytes"] < row["base3_bytes"]
    models = [row["model"] for row in report["gradient_sizes"]]
    assert models[:3] == ["mlp 64-128-10", "cnn 2 conv + fc", "digits:mlp @0"]


def test_table_report_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(
        ["compression", "--numel", "1000", "--repeats", "1", "--no-gradients", "--shapes", "flat"]
    )
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "decode_update ternary 2-bit" in out and "GB/s" in out and "x ref" in out
    assert _parse(["compression"]).shapes == "both"
    with pytest.raises(SystemExit):
        _parse(["nothing"])


def test_gradient_models_are_dataset_arch_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_models("digits:mlp, fashion-mnist:cnn,") == [
        ("digits", "mlp"),
        ("fashion-mnist", "cnn"),
    ]
    with pytest.raises(ValueError, match="dataset:arch"):
        parse_models("digits")
    args = _parse(["compression", "--numel", "10", "--gradient-models", "mlp", "--shapes", "flat"])
    assert bench.run(args) == 2
    assert "dataset:arch" in capsys.readouterr().out
