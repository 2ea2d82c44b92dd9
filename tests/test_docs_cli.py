"""The README's command table names every subcommand; docs/cli.md lists every run-config key."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from fedddl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _subcommands() -> set[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return set(actions[0].choices)


def _section(page: str, heading: str) -> str:
    text = (ROOT / page).read_text(encoding="utf-8")
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def test_readme_command_table_names_every_subcommand() -> None:
    table = _section("README.md", "## Command line")
    named = set(re.findall(r"^\| `fedddl ([a-z]+)", table, re.MULTILINE))
    assert named == _subcommands()


def test_docs_cli_lists_every_run_config_key() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with (ROOT / "pyproject.toml").open("rb") as handle:
        keys = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    table = _section("docs/cli.md", "## Run-config keys")
    listed = set(re.findall(r"`([a-z0-9-]+)`", table))
    assert set(keys) - listed == set()
