"""Command-line options shared by several subcommands."""

from __future__ import annotations

import argparse


def add_set_option(parser: argparse.ArgumentParser, example: str = "training.steps=20") -> None:
    """``--set KEY=VALUE`` (repeatable; values parsed as YAML), collected in ``args.overrides``."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value (parsed as YAML), e.g. --set {example}; repeatable",
    )
