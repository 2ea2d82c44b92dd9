"""``fedddl bench compression`` runs and reports every case (tiny sizes)."""

from __future__ import annotations

import argparse
import json

import pytest

from fedddl.commands import bench


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["compression", "--numel", "10001", "--repeats", "1", "--json"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    cases = {row["case"]: row for row in report["throughput"]}
    for name in (
        "memory copy, new tensor (clone)",
        "memory copy, warm buffer (copy_)",
        "naive: torch.rand ternarize + pack",
        "decode_update ternary 2-bit, out=warm",
        "decode_update ternary base-3, out=warm",
    ):
        assert name in cases
    two_bit = cases["encode_update ternary 2-bit"]
    assert two_bit["message_bytes"] == 18 + 2 + 6 + 3 + 8 + 4 + 4 + 2501
    assert all(row["gb_per_s"] > 0 for row in report["throughput"])
    for row in report["gradient_sizes"]:
        # not quite 16x: the headers of the small bias tensors cost a little
        assert row["base3_bytes"] < row["2bit_bytes"] < row["fp32_bytes"] / 14


def test_table_report_and_bad_target(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["compression", "--numel", "1000", "--repeats", "1", "--no-gradients"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "decode_update ternary 2-bit" in out and "GB/s" in out
    with pytest.raises(SystemExit):
        _parse(["nothing"])
