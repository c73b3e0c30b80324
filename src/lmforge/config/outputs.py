"""Where a run writes: ``output_dir`` and the output paths placed under it, and ``--output-dir``.

``--output-dir DIR`` moves every output of the run: ``output_dir`` becomes DIR and each output path
that the file places under its own ``output_dir`` (``checkpoint.save_path``,
``monitor.tensorboard.output_dir``, ``monitor.wandb.dir``, ``profiler.output_path``) keeps its place
relative to it. Paths elsewhere are the user's explicit choice and stay. Two runs of one file with
different ``--output-dir`` therefore never mix their files. ``--set output_dir=DIR`` does the same,
except for the paths that command line also sets.

``checkpoint.load_path`` is an input, not an output: it names the weights the run starts from (an
earlier run's checkpoint, a Hugging Face directory), and stays exactly as written even when it lies
under the file's ``output_dir`` (moving it would start a fine-tune from whatever is, or is not, at the
new place).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.config.schema import TrainConfig

# (section, key) of every path a run writes that may sit under output_dir.
OUTPUT_PATHS: tuple[tuple[str, ...], ...] = (
    ("checkpoint", "save_path"),
    ("monitor", "tensorboard", "output_dir"),
    ("monitor", "wandb", "dir"),
    ("profiler", "output_path"),
)
DEFAULT_OUTPUT_DIR = "./output"


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` when it lies under it (lexically), else None."""
    p, r = os.path.normpath(path), os.path.normpath(root)
    if p == r:
        return "."
    try:
        rel = PurePath(p).relative_to(PurePath(r))
    except ValueError:
        return None
    return str(rel)


def _moved(value: Any, old: str, new: str) -> Any:
    if not isinstance(value, str) or not value:
        return value
    rel = _under(value, old)
    return value if rel is None else os.path.normpath(os.path.join(new, rel))


def _set(node: Any, keys: tuple[str, ...], old: str, new: str) -> Any:
    """A copy of the frozen section ``node`` with the path at ``keys`` moved from ``old`` to ``new``."""
    child = getattr(node, keys[0])
    if len(keys) == 1:
        return node.model_copy(update={keys[0]: _moved(child, old, new)})
    return node.model_copy(update={keys[0]: _set(child, keys[1:], old, new)})


def with_output_dir(
    cfg: TrainConfig,
    new_dir: str | os.PathLike,
    *,
    old_dir: str | None = None,
    keep: frozenset[str] = frozenset(),
) -> TrainConfig:
    """``cfg`` (a ``TrainConfig``) with every output moved to ``new_dir`` (see the module docstring),
    from ``old_dir`` (default: ``cfg.output_dir``); the dotted keys in ``keep`` stay as they are."""
    old, new = old_dir or cfg.output_dir or DEFAULT_OUTPUT_DIR, str(new_dir)
    for keys in OUTPUT_PATHS:
        if ".".join(keys) not in keep:
            cfg = _set(cfg, keys, old, new)
    return cfg.model_copy(update={"output_dir": new})


def follow_output_dir_override(cfg: TrainConfig, file_raw: Mapping[str, Any], overrides: Any) -> TrainConfig:
    """``--set output_dir=X`` moves what ``--output-dir X`` moves: the paths the file places under its
    own ``output_dir`` follow it, except those the same command line also sets (explicit, kept)."""
    if isinstance(overrides, Mapping):
        keys = [str(k) for k in overrides]
    else:
        items = [overrides] if isinstance(overrides, str) else list(overrides or [])
        keys = [str(item).split("=", 1)[0].strip() for item in items]
    if "output_dir" not in keys:
        return cfg
    old = file_raw.get("output_dir") if isinstance(file_raw.get("output_dir"), str) else None
    return with_output_dir(cfg, cfg.output_dir, old_dir=old or DEFAULT_OUTPUT_DIR, keep=frozenset(keys))


def output_locations(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(what, where) for every output of a run of ``cfg`` (what ``lmforge check`` prints)."""
    run = cfg.output_dir
    rows = [
        ("log, metrics.jsonl, curves.png, summary.json", run),
        (
            "TensorBoard events",
            cfg.monitor.tensorboard.output_dir or os.path.join(run, "tensorboard"),
        ),
    ]
    if cfg.checkpoint.load_path:  # an input, printed so that --output-dir's effect on it shows: none
        rows.append(("weights loaded from (checkpoint.load_path, never moved)", cfg.checkpoint.load_path))
    if cfg.checkpoint.enable_save:
        rows.append(("checkpoints", cfg.checkpoint.save_path))
    else:
        rows.append(("checkpoints", "none (checkpoint.enable_save is false or the section is omitted)"))
    rows.append(
        ("monitor JSON lines (monitor.train_state / moe_monitor, when on)", os.path.join(run, "monitor"))
    )
    if cfg.profiler.enable_profiling:
        rows.append(("profiler traces", cfg.profiler.output_path or os.path.join(run, "profile")))
    if cfg.monitor.wandb.enable:
        wandb_dir = (
            cfg.monitor.wandb.dir or os.environ.get("WANDB_DIR") or run
        )  # the YAML wins over the variable
        rows.append(("W&B run files (monitor.wandb)", os.path.join(wandb_dir, "wandb")))
    if cfg.monitor.mlflow.enable:
        default = f"sqlite:///{os.path.join(run, 'mlflow.db')} (+ mlartifacts/)"
        uri = cfg.monitor.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default
        rows.append(("MLflow store (monitor.mlflow)", uri))
    return rows
