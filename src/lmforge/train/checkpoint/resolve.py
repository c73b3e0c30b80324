"""Finding a checkpoint from ``checkpoint.load_path`` and reading its ``common.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import CheckpointError
from lmforge.models.common.fused_layout import WEIGHT_LAYOUT
from lmforge.train.checkpoint.files import (
    COMMON_FILE,
    HF_WEIGHT_FILES,
    KNOWN_FORMATS,
    TRACKER_FILE,
    iteration_dir_name,
    read_tracker,
)
from lmforge.train.checkpoint.safe_load import read_dcp_metadata
from lmforge.utils.atomic import recover_dir
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")


@dataclass
class CheckpointHeader:
    """A resolved checkpoint: what kind it is, where, and its ``common.json``."""

    kind: str  # "dcp" or "hf"
    path: Path
    common: dict[str, Any] = field(default_factory=dict)

    @property
    def has_optimizer(self) -> bool:
        return bool(self.common.get("has_optimizer", False))

    @property
    def global_step(self) -> int:
        return int(self.common.get("global_step", 0))


# Checkpoints written before common.json recorded weight_layout (format lmforge-dcp/1 only) have layout 1.
_LAYOUT_BEFORE_RECORDED = 1
KNOWN_WEIGHT_LAYOUTS = (1, WEIGHT_LAYOUT)


def is_hf_model_dir(path: Path) -> bool:
    if any((path / name).is_file() for name in HF_WEIGHT_FILES):
        return True
    return any(path.glob("*model.safetensors.index.json"))


def holds_nothing(path: Path) -> bool:
    """A missing path, or a directory without visible entries (a run lock or the hidden leftovers of
    an interrupted save do not make a checkpoint)."""
    if not path.exists():
        return True
    return path.is_dir() and not any(not p.name.startswith(".") for p in path.iterdir())


def empty_load_path_message(load_path: str | os.PathLike, key: str = "checkpoint.load_path") -> str:
    state = "does not exist" if not Path(load_path).exists() else "holds no checkpoint (it is empty)"
    return (
        f"{key} {str(load_path)!r} {state}. An explicit load path must hold a checkpoint (a save_path with "
        f"{TRACKER_FILE}, an iteration_XXXXXXXX directory, or a Hugging Face model directory): fix the path, or "
        "remove load_path to start from scratch. To resume only when a checkpoint is there (e.g. the same "
        "command for the first launch and every re-launch), set checkpoint.auto_resume: true: it resumes "
        "from the newest checkpoint in checkpoint.save_path and starts from scratch while there is none."
    )


def resolve_checkpoint(
    load_path: str | os.PathLike, what: str = "checkpoint.load_path"
) -> CheckpointHeader | None:
    """Resolve a checkpoint path; None when there is nothing there (an empty path, a missing path, or a
    directory without visible entries), for the caller to refuse in its own terms: ``train`` refuses an
    explicit ``checkpoint.load_path`` that holds nothing before building anything
    (``resume.load_path_problem``; the original only warned and trained from scratch), the tools name
    their ``--checkpoint``. An HF model directory is used as is; a save directory with a tracker
    resolves to its latest iteration; otherwise the path must be an iteration directory itself.
    ``what`` names the path in errors: the key or option the user gave it with (``--checkpoint``, ...).
    """
    path = Path(load_path)
    if not str(load_path) or holds_nothing(path):
        return None
    if not path.is_dir():
        raise CheckpointError(
            f"{what} {str(path)!r} is a file; it must be a directory: a checkpoint save_path "
            f"(with {TRACKER_FILE}), one iteration_XXXXXXXX directory, or a Hugging Face model directory."
        )
    if is_hf_model_dir(path):
        _check_hf_index(path)
        return CheckpointHeader("hf", path, {})
    step = read_tracker(path)
    if step is not None:
        it = path / iteration_dir_name(step)
        if not it.is_dir():
            it = _recovered_iteration(it)
        if not it.is_dir():
            raise CheckpointError(
                f"{path / TRACKER_FILE} names iteration {step}, but {it} does not exist. Point "
                f"{what} at an existing iteration_XXXXXXXX directory."
            )
        path = it
    if not (path / ".metadata").is_file():
        found = sorted(p.name for p in path.glob("iteration_*") if p.is_dir())
        hint = f" It contains {', '.join(found[-3:])} but no {TRACKER_FILE}." if found else ""
        raise CheckpointError(
            f"{what} {str(Path(load_path))!r} is not a checkpoint: expected a save_path with "
            f"{TRACKER_FILE}, an iteration_XXXXXXXX directory (with a DCP .metadata file), or a Hugging Face "
            f"model directory (model.safetensors or *model.safetensors.index.json).{hint}"
        )
    common = _read_common(path / COMMON_FILE)
    if "has_optimizer" not in common:  # checkpoints of lmforge-dcp/1 written before the key existed
        common["has_optimizer"] = any(
            k.startswith("optimizer.") for k in _read_metadata(path).state_dict_metadata
        )
    return CheckpointHeader("dcp", path, common)


def _read_common(common_file: Path) -> dict[str, Any]:
    """``common.json``, every field the loader relies on checked: no default stands in for a missing or
    damaged record (a wrong ``weight_layout`` would silently re-permute the fused weights)."""
    if not common_file.is_file():
        raise CheckpointError(
            f"{common_file} is missing: every lmforge checkpoint has one (step, data position, weight layout, "
            "format), and without it the checkpoint cannot be read correctly. The checkpoint is incomplete; use "
            "another iteration of the save_path."
        )
    try:
        common = json.loads(common_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        common = exc
    if not isinstance(common, dict):
        raise CheckpointError(
            f"{common_file} is not the JSON object lmforge writes ({common if isinstance(common, Exception) else type(common).__name__}); "
            "the checkpoint is corrupt or truncated. Use another iteration of the save_path."
        )
    for key in ("global_step", "consumed_samples", "world_size", "global_batch_size"):
        if key in common and (
            isinstance(common[key], bool) or not isinstance(common[key], int) or common[key] < 0
        ):
            raise CheckpointError(
                f"{common_file}: {key} must be a non-negative integer, found {common[key]!r}; the checkpoint is "
                "corrupt. Use another iteration of the save_path."
            )
    fmt = common.get("format")
    if fmt not in KNOWN_FORMATS:
        raise CheckpointError(
            f"{common_file}: format is {fmt!r}; this lmforge reads {', '.join(map(repr, KNOWN_FORMATS[:-1]))} and {KNOWN_FORMATS[-1]!r}. "
            "The file is damaged or comes from another program or a newer lmforge."
        )
    layout = common.get("weight_layout", _LAYOUT_BEFORE_RECORDED if fmt == "lmforge-dcp/1" else None)
    if type(layout) is not int or layout not in KNOWN_WEIGHT_LAYOUTS:  # not true, 2.0, "2"
        found = "it is missing" if "weight_layout" not in common else f"found {common['weight_layout']!r}"
        raise CheckpointError(
            f"{common_file}: weight_layout must be one of the integers {list(KNOWN_WEIGHT_LAYOUTS)} (the row "
            f"layout of the fused weights), {found}. The checkpoint is damaged; use another iteration of the "
            "save_path."
        )
    common["weight_layout"] = layout
    for key in ("optimizer_type", "optimizer_format"):
        if common.get(key) is not None and not isinstance(common[key], str):
            raise CheckpointError(
                f"{common_file}: {key} must be a string, found {common[key]!r}; the checkpoint is damaged. Use "
                "another iteration of the save_path."
            )
    return common


def _recovered_iteration(it: Path) -> Path:
    """The iteration a crash during a re-save left under its ``.old`` name (put back when possible)."""
    old = it.with_name(f".{it.name}.old")
    if not (old / ".metadata").is_file():
        return it
    try:
        recover_dir(it)
    except OSError:
        return old  # a read-only save_path: load it where it is
    logger.warning("Recovered %s from %s (a crash interrupted its re-save).", it, old.name)
    return it


def _check_hf_index(path: Path) -> None:
    for index in path.glob("*model.safetensors.index.json"):
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(
                f"The Hugging Face index {index} lists weight files that are missing from {path}: "
                f"{', '.join(missing[:5])}. Download the complete model directory."
            )


def _read_metadata(path: Path):
    # Never pickle.load: see train/checkpoint/safe_load.py (a .metadata file could otherwise run code).
    return read_dcp_metadata(path)
