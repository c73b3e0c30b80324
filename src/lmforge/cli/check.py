"""``lmforge check``: validate a train.yaml, print it resolved, and the quantities derived from it.

Exit 0 when the configuration is valid, 2 (via the CLI's LmforgeError handling) when it is not.
Missing data files are warnings here; the trainer refuses them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from lmforge.cli.options import add_set_option
from lmforge.config import derive, read_raw
from lmforge.config.load import apply_overrides, split_key, validate_config
from lmforge.errors import ConfigError, LmforgeError

# Validation owned by the building blocks (which scheduler keys a scheduler takes, which model types
# exist, Muon's rules...): (module, function, section attribute, extra keyword arguments from the
# whole config). Each function takes the section and raises an LmforgeError; a module or function
# that does not exist is skipped.
BUILDER_CHECKS: list[tuple[str, str, str, Callable[[Any], dict[str, Any]]]] = [
    ("lmforge.models", "validate_model_section", "model", lambda cfg: {}),
    ("lmforge.optim", "validate_optimizer_section", "optimizer", lambda cfg: {}),
    # The original injects total_steps = training.steps into every scheduler.
    (
        "lmforge.lr",
        "validate_scheduler_section",
        "lr_scheduler",
        lambda cfg: {"total_steps": cfg.training.steps},
    ),
    # The model's vocabulary and sequence length, as `lmforge train` checks them (eod < vocab_size, ...).
    ("lmforge.data", "validate_dataset_section", "train_dataset", lambda cfg: _model_limits(cfg)),
]


def _model_limits(cfg: Any) -> dict[str, Any]:
    from lmforge.models import build_model_config

    try:
        model = build_model_config(cfg.model)
    except LmforgeError:
        return {}  # the model section's own check reports it
    return {"vocab_size": model.vocab_size, "seq_length": model.seq_length}


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
            "Validate a train.yaml without training: print every value with defaults filled in, marked "
            "[file], [--set] or [default], then the derived quantities (data-parallel degree, "
            "gradient-accumulation steps, warm-up steps). Exit 0 when valid, 2 when not."
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


def _data_file_warnings(cfg: Any) -> list[str]:
    loader = cfg.train_dataset.dataloader.to_dict()
    inner = loader.get("config") if isinstance(loader.get("config"), Mapping) else {}
    candidates: list[tuple[str, Any]] = []
    for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if key in inner:
            candidates.append((f"train_dataset.dataloader.config.{key}", inner[key]))
    for key in ("dataset_files", "dataset_dir", "data_path"):
        if key in loader:
            candidates.append((f"train_dataset.dataloader.{key}", loader[key]))
    warnings = []
    for label, value in candidates:
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not isinstance(item, str) or re.fullmatch(r"\s*[-+]?[\d.eE]+\s*", item):
                continue  # blend weights ('1', 0.3) sit between the prefixes
            if os.path.exists(item) or (os.path.exists(item + ".bin") and os.path.exists(item + ".idx")):
                continue
            warnings.append(
                f"{label}: {item!r} not found (neither the path nor {item}.bin/.idx exists); training will "
                "refuse to start until it does"
            )
    return warnings


def _data_source_is_open(cfg: Any) -> bool:
    """True when the file does not say (in a form lmforge reads) where the data is.

    The original accepts such a file and fails only when the dataset is built; `lmforge check`
    validates the configuration the same way (a warning), like a missing data file, and
    `lmforge train` refuses it before any work starts.
    """
    loader = cfg.train_dataset.dataloader.to_dict()
    return loader.get("type") != "BlendedMegatronDatasetDataLoader" or not isinstance(
        loader.get("config"), Mapping
    )


def _builder_checks(cfg: Any) -> list[str]:
    """Run the building blocks' own validation; returns warnings (data sources not readable yet)."""
    warnings: list[str] = []
    for module_name, function_name, attribute, kwargs in BUILDER_CHECKS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        check = getattr(module, function_name, None)
        if not callable(check):
            continue
        try:
            check(getattr(cfg, attribute), **kwargs(cfg))
        except LmforgeError as exc:
            if attribute != "train_dataset" or not _data_source_is_open(cfg):
                raise
            warnings.append(f"{exc} `lmforge train` will refuse to start until this is changed.")
    return warnings


def _schedule_lines(cfg: Any) -> list[str]:
    """The schedule as the trainer will build it (warm-up and decay boundaries resolved by lmforge.lr)."""
    from lmforge.lr import build_scheduler

    schedule = build_scheduler(cfg.lr_scheduler, cfg.training.steps)
    lines = [f"  learning rate: {schedule.description}"]
    boundaries = schedule.boundaries()
    warmup = boundaries.get("warm-up end")
    lines.append(f"  warm-up steps: {warmup if warmup else 0}")
    for name, step in boundaries.items():
        if name != "warm-up end":
            lines.append(f"  {name}: step {step}")
    lines += [f"  warning: {note}" for note in schedule.warnings]
    return lines


def _parallel_plan_lines(cfg: Any, world: int) -> list[str]:
    """The mesh, each rank's share and a per-rank memory estimate (lmforge.parallel.report)."""
    from lmforge.parallel.report import parallel_plan

    return parallel_plan(cfg.parallelism, cfg.model, cfg.training, cfg.optimizer, world)


def run(args: argparse.Namespace) -> int:
    world = _world_size(args)
    file_raw, source = read_raw(args.config)
    merged = apply_overrides(file_raw, args.overrides)
    cfg = validate_config(merged, source, log_warnings=False)  # printed below with the others
    data_warnings = _builder_checks(cfg)
    derived = derive(cfg, world)
    set_keys = [item.split("=", 1)[0].strip() for item in args.overrides]

    lines = [f"{source}: valid configuration.", "", "Resolved configuration ([file] / [--set] / [default]):"]
    for key, value in _leaves(cfg.to_dict()):
        lines.append(f"  {key}: {_format_value(value)}  [{_source_of(key, value, file_raw, set_keys)}]")
    lines += ["", f"Derived quantities (world size {world}):"]
    lines.append(
        f"  data parallel: {derived.data_parallel} (replicate {derived.data_parallel_replicate} x shard "
        f"{derived.data_parallel_shard}); tensor {cfg.parallelism.tensor_parallel}, pipeline "
        f"{cfg.parallelism.pipeline_parallel}, context {cfg.parallelism.context_parallel}, expert "
        f"{cfg.parallelism.expert_parallel}; sequence parallel "
        f"{'on' if cfg.parallelism.sequence_parallel else 'off'}"
    )
    lines.append(
        f"  gradient accumulation steps: {derived.accumulation_steps} = global_batch_size "
        f"{cfg.training.global_batch_size} // (local_batch_size {cfg.training.local_batch_size} x data "
        f"parallel {derived.data_parallel})"
    )
    lines.append(f"  effective global batch: {derived.effective_global_batch_size} samples per step")
    if derived.micro_batch_tokens is not None:
        tokens = derived.effective_global_batch_size * cfg.model.seq_length
        lines.append(f"  tokens per step: {tokens} (seq_length {cfg.model.seq_length})")
    lines.append(f"  total steps: {derived.total_steps}")
    lines += _schedule_lines(cfg)
    lines += ["", *_parallel_plan_lines(cfg, world)]
    warnings = list(cfg.warnings) + derived.warnings + data_warnings + _data_file_warnings(cfg)
    if warnings:
        lines += ["", "Warnings:"] + [f"  - {w}" for w in warnings]
    print("\n".join(lines))
    return 0
