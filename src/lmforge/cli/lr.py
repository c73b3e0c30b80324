"""``lmforge lr``: draw the learning-rate schedule of one or more train.yaml files.

Prints the lr at the key steps (start, warm-up end, decay boundaries, end), writes a plot with the
boundaries marked and, with ``--csv``, the lr of every step 0..training.steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lmforge.cli.options import add_set_option
from lmforge.config import apply_overrides, read_raw, validate_config, validate_section
from lmforge.config.outputs import follow_output_dir_override
from lmforge.errors import ConfigError
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
    add_set_option(parser, "training.steps=5000")
    parser.add_argument(
        "-o",
        "--output",
        default="lr.png",
        metavar="PNG",
        help="the plot to write; its extension picks the format, none means .png (default: lr.png)",
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


def _section(name: str, raw: Any, source: str) -> Any:
    try:
        return validate_section(name, raw)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _load(path: str, overrides: list[str]) -> tuple[Any, int, str | None]:
    """(lr_scheduler section, training.steps, note) of a config.

    A whole train.yaml is validated with load_config. A file that is not a complete config (a spec
    fragment, or one with a mistake elsewhere) still gets its schedule drawn from its lr_scheduler
    and training sections, with a note saying so.
    """
    # The file is read once: a file the YAML reader refuses (malformed, or past the size bounds) is refused
    # here with no fallback; reading it again for the fallback doubled the time a hostile file takes.
    file_raw, source = read_raw(path)
    raw = apply_overrides(file_raw, overrides)
    try:
        cfg = follow_output_dir_override(validate_config(raw, source), file_raw, overrides)
    except ConfigError:
        if (
            not isinstance(raw.get("lr_scheduler"), dict)
            or (raw.get("training") or {}).get("epochs") is not None
        ):
            raise  # with training.epochs the total comes from the data, which needs the whole file
    else:
        if cfg.training.epochs is None:
            return cfg.lr_scheduler, cfg.training.steps, None
        from lmforge.parallel.plan import RunPlan

        steps = RunPlan.from_config(cfg, 1).total_steps
        return (
            cfg.lr_scheduler,
            steps,
            f"training.steps {steps} derived from training.epochs {cfg.training.epochs} for one process "
            "(lmforge check --world-size N shows another layout's)",
        )
    section = _section("lr_scheduler", raw["lr_scheduler"], source)
    training = _section("training", raw.get("training") or {}, source)
    steps_from = (
        "" if "steps" in (raw.get("training") or {}) else f", training.steps {training.steps} by default"
    )
    note = (
        f"{source} is not a complete, valid train.yaml (lmforge check --config {source} says why); only "
        f"its lr_scheduler and training sections were read{steps_from}."
    )
    return section, training.steps, note


_PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


def _check_outputs(args: argparse.Namespace) -> None:
    from lmforge.utils.atomic import check_output_file

    if Path(args.output).is_dir():
        raise ConfigError(
            f"-o/--output {args.output!r} is a directory; give the plot's file name (e.g. -o lr.png; a name with no "
            "extension gets .png)."
        )
    suffix = Path(args.output).suffix.lstrip(".").lower()
    if not suffix:  # as matplotlib itself does: the default format's extension, and say so
        args.output = f"{args.output}.png"
        suffix = "png"
    if suffix not in _PLOT_FORMATS:
        raise ConfigError(
            f"-o/--output {args.output!r}: the plot's format comes from its extension, and "
            f"{('.' + suffix) if suffix else 'no extension'} is not one of {', '.join(_PLOT_FORMATS)} "
            "(e.g. -o lr.png)."
        )
    check_output_file(args.output, "-o/--output")
    if args.csv is not None:
        check_output_file(args.csv, "--csv")


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    items, notes = [], []
    for path, label in zip(args.configs, _labels(args.configs)):
        section, total, note = _load(path, args.overrides)
        items.append(LabelledSchedule(label, build_scheduler(section, total), total))
        notes.append(note)

    for index, (item, note) in enumerate(zip(items, notes)):
        if index:
            print()
        if note:
            print(f"note: {note}")
        print(format_key_steps(item))
    # The checks above accept a directory still to be created (as every output of lmforge does); create
    # it, or the aside-written file failed with a message naming its temporary name.
    for output in (args.output, args.csv):
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
    plot(items, args.output)
    print(f"\nplot: {args.output}")
    if args.csv:
        write_csv(items, args.csv)
        print(f"csv: {args.csv}")
    return 0
