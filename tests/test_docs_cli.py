"""The README's command table names every subcommand; docs/cli.md lists every run-config key."""

from __future__ import annotations

import argparse
import re
import shlex
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


def _bash_blocks(text: str) -> list[str]:
    """The ``bash`` code blocks of a Markdown page, continuation lines joined."""
    blocks, current, language = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language = line[3:].strip()
                current = []
            else:
                if language == "bash":
                    blocks.append("\n".join(current).replace("\\\n", " "))
                language = None
        elif language is not None:
            current.append(line)
    return blocks


def _fedddl_commands(page: Path) -> list[list[str]]:
    """Every ``fedddl ...`` command line of a page's bash blocks, as argv after ``fedddl``."""
    commands = []
    for block in _bash_blocks(page.read_text(encoding="utf-8")):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            starts = [0] + [i + 1 for i, word in enumerate(words) if word == "&&"]
            for start in starts:  # each command of `a && b`, after its `VAR=value` words
                while start < len(words) and re.fullmatch(r"[A-Z_]+=\S*", words[start]):
                    start += 1
                if start < len(words) and words[start] == "fedddl":
                    end = words.index("&&", start) if "&&" in words[start:] else len(words)
                    commands.append(words[start + 1 : end])
    return commands


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_shows_the_commands_it_promises() -> None:
    commands = _fedddl_commands(ROOT / "README.md")
    assert ["run", "--federation-config", "num-supernodes=10"] in commands
    assert {argv[0] for argv in commands} >= {"run", "simulate", "partition", "gossip"}


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_fedddl_command_shown_parses(page: Path) -> None:
    """The options a page's commands use exist: a renamed or removed flag fails here."""
    parser = build_parser()
    for argv in _fedddl_commands(page):
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page.relative_to(ROOT)}: fedddl {shlex.join(argv)} does not parse")
