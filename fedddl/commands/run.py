"""``fedddl run``: the Flower app through ``flwr run . local --stream``, leaving nothing running."""

from __future__ import annotations

import argparse

NAME = "run"
HELP = (
    "run the Flower app with `flwr run APP local --stream` on a private local SuperLink "
    "that is stopped, with everything it started, when the run ends"
)

__all__ = ["HELP", "NAME", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``run`` options (passed on to ``flwr run``)."""
    parser.add_argument(
        "--app", default=".", help="directory of the Flower app (its pyproject.toml)"
    )
    parser.add_argument(
        "--federation-config",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...'",
        help="passed to flwr run, e.g. \"num-supernodes=10\" (default: Flower's local "
        "federation settings)",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="'KEY=VALUE ...'",
        help="passed to flwr run: keys of [tool.flwr.app.config], e.g. "
        "\"num-server-rounds=50 strategy='fedavg'\" (default: the app's values)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the local SuperLink to start",
    )


def run(args: argparse.Namespace) -> int:
    """Run the app; return ``flwr run``'s exit code (1 if something was left running)."""
    from fedddl.deploy.local_run import run_local
    from fedddl.deploy.processes import DeploymentError

    flwr_args: list[str] = []
    for value in args.federation_config:
        flwr_args += ["--federation-config", value]
    for value in args.run_config:
        flwr_args += ["--run-config", value]
    try:
        result = run_local(args.app, flwr_args, startup_timeout_s=args.startup_timeout)
    except (DeploymentError, FileNotFoundError) as err:
        print(f"fedddl run: {err}")
        return 1
    if result.left_running:
        return result.returncode or 1
    return result.returncode
