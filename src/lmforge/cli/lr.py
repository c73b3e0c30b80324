"""``lmforge lr``: draw the learning-rate schedule of one or more train.yaml files.

Prints the lr at the key steps (start, warm-up end, decay boundaries, end), writes a plot with the
boundaries marked and, with ``--csv``, the lr of every step 0..training.steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lmforge.config import load_config
from lmforge.lr import build_scheduler
from lmforge.lr.report import LabelledSchedule, format_key_steps, plot, write_csv


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "lr",
        help="plot the learning-rate schedule of a train.yaml",
        description=(
            "Build the lr_scheduler of each config over its training.steps, print the lr at the key "
            "steps, draw the schedule(s) with warm-up and decay boundaries marked, and optionally write "
            "step,lr for every step. Update k (1-based) uses the lr at step k - 1."
        ),
    )
    parser.add_argument(
        "--config",
        dest="configs",
        action="append",
        required=True,
        metavar="FILE",
        help="a train.yaml (repeat to overlay several schedules)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value in every config, e.g. --set training.steps=5000 (repeatable)",
    )
    parser.add_argument(
        "-o", "--output", default="lr.png", metavar="PNG", help="the plot to write (default: lr.png)"
    )
    parser.add_argument(
        "--csv",
        default=None,
        metavar="CSV",
        help="also write step,lr for every step 0..training.steps (config,step,lr with several configs)",
    )
    parser.set_defaults(func=run)


def _labels(paths: list[str]) -> list[str]:
    """Short names for the legend: file stems, or the paths when stems repeat."""
    stems = [Path(p).stem for p in paths]
    return stems if len(set(stems)) == len(stems) else list(paths)


def run(args: argparse.Namespace) -> int:
    items = []
    for path, label in zip(args.configs, _labels(args.configs)):
        cfg = load_config(path, args.overrides)
        total = cfg.training.steps
        items.append(LabelledSchedule(label, build_scheduler(cfg.lr_scheduler, total), total))

    for index, item in enumerate(items):
        if index:
            print()
        print(format_key_steps(item))
    plot(items, args.output)
    print(f"\nplot: {args.output}")
    if args.csv:
        write_csv(items, args.csv)
        print(f"csv: {args.csv}")
    return 0
