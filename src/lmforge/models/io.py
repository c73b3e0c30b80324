"""A model-only lmforge checkpoint: ``model.safetensors`` (lmforge names) + ``lmforge_model.json``.

``lmforge convert`` reads and writes this form. ``lmforge_model.json`` holds the validated ``model``
section, so the directory rebuilds the same model without the training YAML.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmforge.errors import CheckpointError, ConfigError
from lmforge.models.build import build_from_config
from lmforge.models.common.dtypes import dtype_name
from lmforge.models.common.gpt import GPTModel
from lmforge.models.registry import resolve

WEIGHTS_FILE = "model.safetensors"
SECTION_FILE = "lmforge_model.json"


def saved_compute_dtype(path: str | Path) -> torch.dtype:
    """The ``compute_dtype`` a model-only checkpoint's section names (float32 for ``auto``, whose choice
    depends on the machine: the dtype an export of it defaults to)."""
    section_file = Path(path) / SECTION_FILE
    try:
        cfg = resolve(json.loads(section_file.read_text())).config
    except (OSError, ConfigError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{section_file}: {exc}") from None
    return torch.float32 if cfg.compute_dtype_auto else cfg.compute_dtype


def save_model_checkpoint(model: GPTModel, path: str | Path, section: dict | None = None) -> None:
    """Write ``model``'s tensors as they are and its section (``section`` when given: the same structure
    with another ``compute_dtype``, e.g. fp32 weights of a bf16 model)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if section is None:
        section = {**model.config.section, "compute_dtype": dtype_name(model.config.compute_dtype)}
    (path / SECTION_FILE).write_text(json.dumps(section, indent=2, sort_keys=True, default=str) + "\n")
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt", "producer": "lmforge"})


def load_model_checkpoint(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPTModel:
    """The model of a model-only checkpoint; ``dtype`` builds it in that dtype instead of the saved
    section's ``compute_dtype`` (the export reads the weights in float32 to keep them whole)."""
    path = Path(path)
    section_file, weights_file = path / SECTION_FILE, path / WEIGHTS_FILE
    for f in (section_file, weights_file):
        if not f.exists():
            raise CheckpointError(
                f"{f} does not exist; a model-only lmforge checkpoint has {SECTION_FILE} and {WEIGHTS_FILE}."
            )
    try:
        section = json.loads(section_file.read_text())
        if dtype is not None and isinstance(section, dict):
            section["compute_dtype"] = dtype_name(dtype)
        typed = resolve(section)
    except (ConfigError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{section_file}: {exc}") from None
    model = build_from_config(typed.config, typed.model_class, "meta")
    model.to_empty(device=device or "cpu")
    model.init_weights()
    missing, unexpected = model.load_state_dict(load_file(str(weights_file)), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{weights_file}: tensors missing {missing[:8]} / unexpected {unexpected[:8]}.")
    return model
