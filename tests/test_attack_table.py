"""simulations/attack_table.py: every cell is a valid run, in-process and as a command line."""

from __future__ import annotations

import argparse

from fedddl.app_config import AppConfig
from fedddl.commands.simulate import add_arguments
from simulations import attack_table


def test_every_cell_is_a_valid_run_config_and_simulate_command() -> None:
    table = attack_table
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for attack, attackers, column in table.cells():
        keys = table.run_config(attack, attackers, column, rounds=3)
        cfg = AppConfig.from_run_config({k: v for k, v in keys.items() if k != "num-clients"})
        assert (cfg.attack, cfg.num_attackers) == (attack, attackers)
        flags = [token for key, value in table.COLUMNS[column].items()
                 for token in (f"--{key}", str(value))]  # fmt: skip
        args = parser.parse_args(flags)
        for key, value in table.COLUMNS[column].items():
            field = key.replace("-", "_")
            assert getattr(args, field) == value == getattr(cfg, field)
        # the Ray run's command line carries every key of the cell
        command = parser.parse_args(table.simulate_flags(keys))
        assert (command.rounds, command.num_clients) == (3, keys["num-clients"])
        for key, value in keys.items():
            if key not in ("num-server-rounds", "num-clients"):
                assert getattr(command, key.replace("-", "_")) == value


def test_plain_mean_turns_the_defences_off() -> None:
    table = attack_table
    cfg = AppConfig.from_run_config(
        {k: v for k, v in table.run_config("", 0, "plain mean", 3).items() if k != "num-clients"}
    )
    assert cfg.scale_bound == 0.0 and cfg.resync_interval == 0 and cfg.aggregator == "mean"
    assert cfg.direction_check == 0.0 and cfg.norm_clip == 0.0


def test_the_statistics_rows_come_with_a_batchnorm_model() -> None:
    table = attack_table
    assert not any(a.startswith("bn-statistics") for a, _, _ in table.cells())
    rows = [c for c in table.cells(statistics=True) if c[0].startswith("bn-statistics")]
    assert {(a, n) for a, n, _ in rows} == {(a, 1) for a in table.STATISTICS}
    assert {c for _, _, c in rows} == set(table.COLUMNS)
    keys = table.run_config("bn-statistics:7.9", 1, "mean", 3, arch="resnet8")
    cfg = AppConfig.from_run_config({k: v for k, v in keys.items() if k != "num-clients"})
    assert (cfg.arch, cfg.attack) == ("resnet8", "bn-statistics:7.9")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(table.simulate_flags(keys)).arch == "resnet8"
    assert "arch" not in table.run_config("", 0, "mean", 3)


def test_a_table_can_run_with_other_scale_buckets() -> None:
    table = attack_table
    assert "scale-bucket" not in table.run_config("", 0, "mean", 3)  # the default: auto
    keys = table.run_config("scale:1e6", 1, "mean", 3, scale_bucket="0")
    cfg = AppConfig.from_run_config({k: v for k, v in keys.items() if k != "num-clients"})
    assert (cfg.scale_bucket, cfg.resolved_scale_bucket) == (0, 0)
    assert AppConfig().resolved_scale_bucket == -1
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(table.simulate_flags(keys)).scale_bucket == 0
