"""Every option of every ``fedddl`` subcommand has help text that states its default."""

from __future__ import annotations

import argparse

import pytest

from fedddl.cli import HelpFormatter, build_parser, main


def _subcommands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> list[tuple[str, argparse.ArgumentParser]]:
    """``(name, parser)`` of every (nested) subcommand below ``parser``."""
    found: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                found.append((full, sub))
                found.extend(_subcommands(sub, full))
    return found


SUBCOMMANDS = _subcommands(build_parser())


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]


def test_every_subcommand_is_seen() -> None:
    names = {name for name, _ in SUBCOMMANDS}
    assert {"bench", "deploy", "deploy certs", "gossip", "partition", "report", "simulate"} <= names


@pytest.mark.parametrize(("name", "parser"), SUBCOMMANDS, ids=[n for n, _ in SUBCOMMANDS])
def test_every_option_has_help_with_its_default(name: str, parser: argparse.ArgumentParser) -> None:
    formatter = HelpFormatter(prog="fedddl")
    for action in _options(parser):
        flag = action.option_strings[-1]
        assert action.help and action.help != argparse.SUPPRESS, f"{name} {flag}: no help text"
        if action.nargs == 0:
            continue  # a switch: off unless given
        text = formatter._get_help_string(action) or ""
        assert "default" in text, f"{name} {flag}: help does not state the default: {text!r}"
    for action in parser._actions:  # positionals too
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            assert action.help, f"{name} {action.dest}: no help text"


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["gossip", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "simulated duration, in virtual seconds (default: 60.0)" in out
    assert "--continue-after-target" in out


def test_every_gossip_peer_option_has_help() -> None:
    from fedddl.gossip.peer import build_parser as peer_parser

    for action in _options(peer_parser()):
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings
