"""``lmforge check``: the pre-build validation of ``lmforge train`` (``load_config`` + the run plan),
then the resolved configuration, where every output goes, the run plan and the parallel mesh.

Exit 0 when the configuration is valid, 2 (via the CLI's LmforgeError handling) when it is not.
Missing data files are warnings here; the trainer refuses them (before it builds anything).
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from lmforge.cli.check_problems import find_problems, raise_problems
from lmforge.cli.options import add_set_option
from lmforge.config import TrainConfig, read_raw
from lmforge.config.load import apply_overrides, split_key
from lmforge.config.outputs import follow_output_dir_override, output_locations, with_output_dir
from lmforge.errors import ConfigError


def _bool_flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check",
        help="validate a train.yaml and show the resolved configuration",
        description=(
            "Validate a train.yaml exactly as `lmforge train` does before it builds anything, without "
            "training: print every value with defaults filled in, marked [file], [--set] or [default], "
            "where every output goes, then the run plan (data-parallel degree, gradient-accumulation "
            "steps, batch ramp-up, lr schedule, recompute/swap) and the parallel mesh. Exit 0 when "
            "valid, 2 when not (every problem named at once)."
        ),
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="the train.yaml to check")
    add_set_option(parser, "training.steps=20 --set optimizer.betas=[0.9,0.99]")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="number of processes to derive the data-parallel degree for (default: $WORLD_SIZE or 1)",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help="as for `lmforge train`: every output of the run moves to DIR (shown under 'Outputs')",
    )
    parser.add_argument(
        "--device",
        default=None,
        type=_device_type,
        metavar="D",
        help="as for `lmforge train`: cpu or cuda, the device the run will use (default: cuda when this "
        "machine has it); settings that depend on it are decided for it",
    )
    parser.add_argument(
        "--mode",
        type=int,
        default=1,
        metavar="M",
        help="the original's execution mode flag: 1 (PyNative, eager) is what lmforge always runs; "
        "0 (MindSpore graph mode) is not supported",
    )
    parser.add_argument(
        "--use_parallel",
        "--use-parallel",
        type=_bool_flag,
        default=None,
        metavar="B",
        help="the original's flag: False means one process (world size 1); True means a distributed "
        "launch (lmforge reads the world size from torchrun or --world-size)",
    )
    parser.set_defaults(func=run)


def _device_type(name: str) -> str:
    # Not lmforge.utils.device.parse_device: a GPU run may be checked on a machine without a GPU.
    if name == "cpu" or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(
        f"{name!r} is not a device lmforge runs on; use one of: cpu, cuda, cuda:N"
    )


def _world_size(args: argparse.Namespace) -> int:
    if args.mode != 1:
        raise ConfigError(
            f"--mode {args.mode}: lmforge runs eager PyTorch only, the equivalent of the original's "
            "PyNative mode (--mode 1); graph mode (--mode 0) is not supported. Use --mode 1 or omit it."
        )
    world = args.world_size
    if world is None:
        env = os.environ.get("WORLD_SIZE", "1")
        world = int(env) if env.isdigit() else 1
    if world < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world}")
    if args.use_parallel is False and world > 1:
        raise ConfigError(
            f"--use_parallel False means a single process, but the world size is {world}; drop "
            "--use_parallel False or use --world-size 1."
        )
    return world


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, Mapping) and data and all(isinstance(k, str) for k in data):
        out: list[tuple[str, Any]] = []
        for key, value in data.items():
            out.extend(_leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return [(prefix, data)]


def _lookup(raw: Any, dotted: str) -> tuple[bool, Any]:
    node = raw
    for part in split_key(dotted, dotted):
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                return False, None
            node = node[part]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return False, None
    return True, node


_NOT_SHOWN = object()


def _plain(value: Any) -> Any:
    """``value`` as YAML writes it (tuples as lists), or _NOT_SHOWN when it is not plain data."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_SHOWN if any(v is _NOT_SHOWN for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _NOT_SHOWN if any(v is _NOT_SHOWN for v in items.values()) else items
    return _NOT_SHOWN


def _with_schema_defaults(shown: dict[str, Any], typed: Any) -> None:
    """Add to ``shown`` (a ``type``-dependent section as the file wrote it) the value its typed schema
    gives each key the file omitted: those sections declare only ``type``, and the schema registered
    for the type is the one owner of every other key's default (Muon's eps is not AdamW's)."""
    schema = getattr(typed, "hyper", typed)  # OptimizerOptions keeps its type's schema as ``hyper``
    # An HFDataLoader is typed as the TextDataLoader it translates to, whose keys are not its own.
    if not isinstance(schema, BaseModel) or getattr(schema, "type", None) != shown.get("type"):
        return
    for name, field in type(schema).model_fields.items():
        value = getattr(schema, name)
        if _is_pair_list(
            field.annotation
        ):  # e.g. lr_scale: written as a mapping, held as (rule, value) pairs
            value = dict(value)
        value = _plain(value)
        if name not in shown and value is not _NOT_SHOWN:
            shown[name] = value


def _is_pair_list(annotation: Any) -> bool:
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) is list and len(args) == 1 and typing.get_origin(args[0]) is tuple


def _resolved(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration with defaults filled in, the typed sections' defaults included."""
    resolved = cfg.to_dict()
    _with_schema_defaults(resolved["optimizer"], cfg.optimizer.typed)
    _with_schema_defaults(resolved["lr_scheduler"], cfg.lr_scheduler.typed)
    for name in ("train_dataset", "eval_dataset"):
        section = getattr(cfg, name)
        if section is not None:
            _with_schema_defaults(resolved[name]["dataloader"], section.dataloader.typed)
    return resolved


def _format_value(value: Any) -> str:
    import yaml

    # A scalar document ends with an explicit "..." line; one-line flow style for everything.
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).replace("\n...\n", "").strip()


def _source_of(key: str, value: Any, file_raw: Mapping[str, Any], set_keys: list[str]) -> str:
    for set_key in set_keys:
        # A --set key can be deeper than the printed leaf (a list item) or shallower (a whole mapping).
        if key == set_key or key.startswith(set_key + ".") or set_key.startswith((key + ".", key + "[")):
            return "--set"
    present, raw_value = _lookup(file_raw, key)
    if not present:
        return "default"
    # A value lmforge changed (sequence_parallel under tensor parallel, a null recompute mode).
    return "file, adjusted" if raw_value != value else "file"


def _parallel_plan_lines(cfg: TrainConfig, world: int) -> list[str]:
    """The mesh, each rank's share and a per-rank memory estimate (lmforge.tools.report)."""
    from lmforge.parallel.plan import collected_warnings
    from lmforge.tools.report import parallel_plan

    # The run plan has already collected these sections' warnings; do not print them twice.
    with collected_warnings([]):
        return parallel_plan(cfg.parallelism, cfg.model, cfg.training, cfg.optimizer, world, cfg.recompute)


def _start_refusals(cfg: TrainConfig) -> list[str]:
    """What ``lmforge train`` refuses in the directories the file names; ``check`` warns (the file is valid)."""
    from lmforge.train.checkpoint.resume import load_path_problem
    from lmforge.train.recovery.give_up import give_up_problem

    refusals = []
    problem = load_path_problem(cfg.checkpoint)
    if problem is not None:
        refusals.append(f"{problem} (lmforge train refuses to start until it holds one.)")
    gave_up = give_up_problem(cfg.checkpoint)  # recovery's give-up marker in save_path
    if gave_up is not None:
        refusals.append(gave_up)
    return refusals


def run(args: argparse.Namespace) -> int:
    # lmforge.data imports torch: only when checking
    from lmforge.data.files import cache_dir_problems, missing_data_files, text_loader_problem
    from lmforge.train.preflight import preflight

    world = _world_size(args)
    file_raw, source = read_raw(args.config)
    merged = apply_overrides(file_raw, args.overrides)

    def plan_checks(cfg: TrainConfig) -> Any:
        # Exactly what `lmforge train` runs before building anything.
        cfg = follow_output_dir_override(cfg, file_raw, args.overrides)
        if args.output_dir is not None:
            cfg = with_output_dir(cfg, args.output_dir)
        return cfg, preflight(cfg, world, args.device)

    # Warnings are printed below with the others; every problem of every layer at once.
    _, checked, problems = find_problems(merged, source, plan_checks)
    if problems:
        raise_problems(problems, source)
    cfg, plan = checked
    set_keys = [item.split("=", 1)[0].strip() for item in args.overrides]

    lines = [f"{source}: valid configuration.", "", "Resolved configuration ([file] / [--set] / [default]):"]
    for key, value in _leaves(_resolved(cfg)):
        lines.append(f"  {key}: {_format_value(value)}  [{_source_of(key, value, file_raw, set_keys)}]")
    lines += ["", "Outputs:"] + [f"  {what}: {where}" for what, where in output_locations(cfg)]
    from lmforge.train.preflight import compute_dtype_report
    from lmforge.utils.device import run_device_type

    dtype_line = compute_dtype_report(plan.model_config, run_device_type(args.device))[0]
    lines += ["", f"Run plan (world size {world}):", *plan.describe(cfg), f"  {dtype_line}"]
    lines += ["", *_parallel_plan_lines(cfg, world)]
    warnings = (
        list(cfg.warnings)
        + plan.warnings_beyond(cfg.warnings)
        + [f"{m}; training will refuse to start until it does" for m in missing_data_files(cfg.train_dataset)]
        + [
            f"{p}; training will refuse to start until it can be written"
            for p in cache_dir_problems(cfg.train_dataset, cfg.eval_dataset)
        ]
        + [
            f"{p}; training will refuse to start until it is fixed"
            for p in [
                text_loader_problem(
                    cfg.train_dataset, plan.model_config.seq_length, plan.model_config.vocab_size
                )
            ]
            if p is not None
        ]
        + _start_refusals(cfg)
    )
    if warnings:
        lines += ["", "Warnings:"] + [f"  - {w}" for w in warnings]
    print("\n".join(lines))
    return 0
