"""``scale-bucket = "auto"`` (the default): one scale per output channel where the downlink and
the compressor carry buckets, one per tensor elsewhere; explicit values refused where they
cannot be sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from clients.client_app import make_client_app
from fedddl.app_config import AppConfig
from fedddl.checkpoint import CheckpointError
from fedddl.compression import (
    BUCKETS_VERSION,
    FORMAT_VERSION,
    TernaryCompressor,
    encode_update,
    read_header,
    register_compressor,
    takes_scale_bucket,
)
from fedddl.compression.algorithms import ternary_buckets
from fedddl.compression.algorithms.ternary_buckets import bucket_of
from fedddl.flower.inline_grid import InlineGrid
from fedddl.scale_bucket_choice import (
    AUTO,
    PER_CHANNEL,
    parse_scale_bucket,
    resolve_scale_bucket,
)
from strategies.server_app import _choices_resolved, run_server
from strategies.terngrad import TernGrad


def _per_tensor_only(seed: int = 0, clip_sigma: float = 2.5) -> TernaryCompressor:
    return TernaryCompressor(seed=seed, clip_sigma=clip_sigma, codec="base3")


register_compressor("test-per-tensor-only", _per_tensor_only, overwrite=True)


class PerTensorTernGrad(TernGrad):
    """A user's strategy naming a ternary compressor that takes no scale buckets."""

    def compressor_name(self) -> str:
        return "test-per-tensor-only"


@pytest.mark.parametrize(
    ("value", "downlink", "takes", "expected"),
    [
        (AUTO, "reternarize", True, PER_CHANNEL),
        (AUTO, "grid", True, PER_CHANNEL),
        (AUTO, "auto", True, PER_CHANNEL),
        (AUTO, "shared-scale-sum", True, 0),
        (AUTO, "reternarize", False, 0),
        (0, "shared-scale-sum", False, 0),
        (512, "grid", True, 512),
        (PER_CHANNEL, "reternarize", True, PER_CHANNEL),
    ],
)
def test_resolve_table(value: int | str, downlink: str, takes: bool, expected: int) -> None:
    got = resolve_scale_bucket(
        value, downlink=downlink, compressor="c", compressor_takes_buckets=takes
    )
    assert got == expected


def test_explicit_buckets_with_a_setting_that_cannot_carry_them_are_refused() -> None:
    with pytest.raises(ValueError, match="needs downlink 'reternarize' or 'grid'"):
        resolve_scale_bucket(
            -1, downlink="shared-scale-sum", compressor="c", compressor_takes_buckets=True
        )
    with pytest.raises(ValueError, match="compressor 'c' sends one scale per tensor"):
        resolve_scale_bucket(64, downlink="grid", compressor="c", compressor_takes_buckets=False)
    with pytest.raises(ValueError, match="shared-scale sum"):
        AppConfig(scale_bucket=-1, downlink="shared-scale-sum")
    with pytest.raises(ValueError, match="'ternary-entropy' sends one scale per tensor"):
        AppConfig(scale_bucket=-1, compressor="ternary-entropy")


@pytest.mark.parametrize(
    ("raw", "parsed"), [("auto", AUTO), (-1, -1), ("-1", -1), (0, 0), ("512", 512), (64, 64)]
)
def test_parse_accepts_auto_and_integers(raw: object, parsed: int | str) -> None:
    assert parse_scale_bucket(raw) == parsed


@pytest.mark.parametrize("raw", [-2, "-2", "x", "Auto", 1.5, True, None, ""])
def test_parse_refuses_anything_else_naming_the_choices(raw: object) -> None:
    with pytest.raises(ValueError, match="'auto', 0 \\(per tensor\\)"):
        parse_scale_bucket(raw)


def test_the_constant_is_the_compressors() -> None:
    assert PER_CHANNEL == ternary_buckets.PER_CHANNEL


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, PER_CHANNEL),
        ({"fraction_train": 0.5}, PER_CHANNEL),  # the grid downlink
        ({"downlink": "shared-scale-sum"}, 0),
        ({"compressor": "ternary-entropy"}, 0),
        ({"compressor": "ternary-threshold-base3"}, PER_CHANNEL),
        ({"scale_bucket": 0}, 0),
        ({"scale_bucket": 512}, 512),
        ({"scale_bucket": "-1"}, PER_CHANNEL),
    ],
)
def test_app_config_resolves_auto(settings: dict[str, Any], expected: int) -> None:
    cfg = AppConfig(**settings)
    assert AppConfig().scale_bucket == AUTO
    assert cfg.resolved_scale_bucket == expected
    again = AppConfig.from_run_config(cfg.to_run_config())
    assert again.scale_bucket == cfg.scale_bucket and again.resolved_scale_bucket == expected


def test_run_config_values_are_parsed() -> None:
    assert AppConfig.from_run_config({"scale-bucket": -1}).scale_bucket == -1
    assert AppConfig.from_run_config({"scale-bucket": "auto"}).scale_bucket == AUTO
    assert AppConfig.from_run_config({"scale-bucket": "64"}).scale_bucket == 64
    with pytest.raises(ValueError, match="scale-bucket must be"):
        AppConfig.from_run_config({"scale-bucket": "per-channel"})


def test_which_compressors_take_buckets() -> None:
    assert takes_scale_bucket("ternary-base3") and takes_scale_bucket("ternary")
    assert not takes_scale_bucket("ternary-entropy")
    assert takes_scale_bucket("identity")  # no ternary scales: the value is ignored

    def no_buckets(seed: int = 0, clip_sigma: float = 2.5) -> TernaryCompressor:
        return TernaryCompressor(seed=seed, clip_sigma=clip_sigma)

    register_compressor("test-no-buckets", no_buckets, overwrite=True)
    assert not takes_scale_bucket("test-no-buckets")
    assert AppConfig(compressor="test-no-buckets").resolved_scale_bucket == 0
    with pytest.raises(ValueError, match="'test-no-buckets' sends one scale per tensor"):
        _ = AppConfig(compressor="test-no-buckets", scale_bucket=-1).resolved_scale_bucket
    register_compressor("test-no-buckets", TernaryCompressor, overwrite=True)
    assert takes_scale_bucket("test-no-buckets")  # re-registering forgets the answer
    with pytest.raises(ValueError, match="unknown compressor"):
        takes_scale_bucket("no-such-compressor")


def test_tensors_without_output_channels_keep_one_scale() -> None:
    assert bucket_of((16,), PER_CHANNEL) == 0  # a bias
    assert bucket_of((1, 64), PER_CHANNEL) == 0  # a single output channel
    assert bucket_of((16, 8, 3, 3), PER_CHANNEL) == 72
    tensors = {"bias": torch.randn(16), "w": torch.randn(4, 8)}
    message = encode_update(tensors, TernaryCompressor(seed=0, scale_bucket=PER_CHANNEL))
    assert [e.bucket for e in read_header(message)] == [0, 8]
    only_bias = encode_update({"bias": tensors["bias"]}, TernaryCompressor(seed=0, scale_bucket=-1))
    assert only_bias[4] == FORMAT_VERSION and message[4] == BUCKETS_VERSION


def _run(rounds: int, **settings: Any) -> dict[str, Any]:
    settings = {"eval_every": rounds, **settings}
    cfg = AppConfig(dataset="digits", num_server_rounds=rounds, min_available_nodes=5, **settings)
    result: dict[str, Any] = run_server(
        InlineGrid(make_client_app(cfg), 5), cfg, progress=lambda _: None
    )
    return result


def test_a_default_run_is_the_per_channel_run() -> None:
    auto, explicit, plain = _run(3), _run(3, scale_bucket=-1), _run(3, scale_bucket=0)
    assert auto["config"]["scale-bucket"] == AUTO
    assert auto["config"]["resolved-scale-bucket"] == PER_CHANNEL
    for key in ("bytes_up", "bytes_down"):
        assert [r[key] for r in auto["rounds"]] == [r[key] for r in explicit["rounds"]]
    assert auto["final_fingerprint"] == explicit["final_fingerprint"] is not None
    assert all(r["replicas_equal"] for r in auto["rounds"])
    assert sum(r["bytes_up"] for r in auto["rounds"]) > sum(r["bytes_up"] for r in plain["rounds"])


def test_a_default_run_with_a_per_tensor_compressor_runs_per_tensor() -> None:
    auto = _run(2, compressor="ternary-entropy")
    plain = _run(2, compressor="ternary-entropy", scale_bucket=0)
    assert auto["config"]["resolved-scale-bucket"] == 0
    assert auto["final_fingerprint"] == plain["final_fingerprint"] is not None


def test_a_resume_compares_the_scale_buckets_the_runs_use(tmp_path: Path) -> None:
    def run(path: str, rounds: int, **settings: Any) -> dict[str, Any]:
        return _run(
            rounds, checkpoint_dir=str(tmp_path / path), checkpoint_every=1, eval_every=1,
            **settings,
        )

    run("a", 1, scale_bucket=-1)  # "auto" means the same
    assert run("a", 2)["resumed_from"]["round"] == 1
    run("b", 1, scale_bucket=0)  # "auto" would switch to per channel
    with pytest.raises(CheckpointError, match="scale-bucket: checkpoint 0, run -1"):
        run("b", 2)
    assert run("b", 2, scale_bucket=0)["resumed_from"]["round"] == 1


def test_a_checkpoint_older_than_the_key_ran_per_tensor() -> None:
    assert _choices_resolved({"compressor": "ternary-base3"})["scale-bucket"] == 0
    assert _choices_resolved({"scale-bucket": "auto"})["scale-bucket"] == PER_CHANNEL
    shared = {"scale-bucket": "auto", "downlink": "shared-scale-sum"}
    assert _choices_resolved(shared)["scale-bucket"] == 0


def test_auto_follows_the_compressor_the_server_names() -> None:
    run = _run(
        2,
        strategy="tests.test_scale_bucket_auto:PerTensorTernGrad",
        plugins="tests.test_scale_bucket_auto",
    )
    assert AppConfig().resolved_scale_bucket == PER_CHANNEL  # the config's own compressor
    assert run["config"]["resolved-scale-bucket"] == 0  # the one the server names
    assert all(r["accepted"] and not r["dropped"] for r in run["rounds"]), run["rounds"]
    plain = _run(2, compressor="test-per-tensor-only")
    assert run["final_fingerprint"] == plain["final_fingerprint"] is not None
    with pytest.raises(ValueError, match="'test-per-tensor-only' sends one scale per tensor"):
        _run(
            1,
            strategy="tests.test_scale_bucket_auto:PerTensorTernGrad",
            plugins="tests.test_scale_bucket_auto",
            scale_bucket=-1,
        )
