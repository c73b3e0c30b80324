"""Reading and writing Hugging Face model directories (config.json + safetensors, sharded or not;
tokenizer files and generation_config.json on export)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmforge.errors import CheckpointError, ConfigError
from lmforge.models.build import build_from_config
from lmforge.models.common.config_keys import HF_BOOKKEEPING_KEYS
from lmforge.models.common.dtypes import dtype_name, parse_dtype
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.family import HFAdapter
from lmforge.models.hf_read import load_per_rank, weight_files
from lmforge.models.hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_size, write_sharded
from lmforge.models.registry import family_for, resolve
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.models")


def _adapter(cfg: TransformerConfig) -> HFAdapter:
    return family_for(cfg.model_type).hf_adapter


def section_from_hf_config(hf_cfg: dict[str, Any], dtype: Any = None) -> dict[str, Any]:
    """A lmforge ``model`` section equivalent to a Hugging Face config.json (unknown keys dropped, warned)."""
    family = family_for(hf_cfg.get("model_type"))
    adapter = family.hf_adapter
    valid = set(family.keys.valid_keys())
    section: dict[str, Any] = {}
    dropped = []
    renames = adapter.renames
    for key, value in hf_cfg.items():
        key = renames.get(key, key)
        if key in adapter.derived_keys or key in HF_BOOKKEEPING_KEYS:
            continue
        if key in valid:
            section[key] = value
        else:
            dropped.append(key)
    if dropped:
        _log.warning(
            "config.json keys not used by lmforge's %s: %s",
            family.keys.model_type,
            ", ".join(sorted(dropped)),
        )
    section["model_type"] = family.keys.model_type
    archs = hf_cfg.get("architectures") or list(family.keys.architectures)
    section["architectures"] = archs[0] if isinstance(archs, list) else archs
    chosen = dtype if dtype is not None else hf_cfg.get("dtype", hf_cfg.get("torch_dtype")) or "float32"
    section["compute_dtype"] = dtype_name(parse_dtype(chosen, "dtype"))
    return section


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory, whole (one process; ``load_hf_weights`` reads per rank instead)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(path).items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key in names:
                tensors[key] = f.get_tensor(key)
    return tensors


def hf_state_dict(path: str | Path, cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory under lmforge names, for a model of ``cfg``."""
    path = Path(path)
    hf_sd = read_safetensors_dir(path)
    sd = _adapter(cfg).from_hf(hf_sd, cfg)
    leftover = sorted(k for k in hf_sd if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        _log.warning("%s: %d tensors not used: %s", path, len(leftover), ", ".join(leftover[:8]))
    return sd


def load_hf_weights(model: GPTModel, path: str | Path) -> None:
    """Load a Hugging Face directory's weights into an existing lmforge model (the trainer's ``hf_loader``).

    The directory's config.json must describe the same structure as ``model.config``. Works on sharded
    (DTensor) models and pipeline stages too: each rank reads only the rows and columns of its own
    shards (``lmforge.models.hf_read``), never the whole model.
    """
    path = Path(path)
    hf_cfg = _read_hf_config(path)
    try:
        theirs, _ = resolve(section_from_hf_config(hf_cfg, model.config.compute_dtype))
    except ConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    ours = model.config
    fields = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts",
        "moe_layers",
        "tie_word_embeddings",
    )
    diff = [
        f"{f}: checkpoint {getattr(theirs, f)!r} vs model {getattr(ours, f)!r}"
        for f in fields
        if getattr(theirs, f) != getattr(ours, f)
    ]
    if diff:
        raise CheckpointError(
            f"{path} is a different model than the model section: {'; '.join(diff[:4])}. Make the model section "
            "match the checkpoint's config.json."
        )
    load_per_rank(model, path, ours, _adapter(ours).from_hf)


def _read_hf_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} does not exist; expected a Hugging Face model directory.")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None


def load_hf_pretrained(
    path: str | Path, dtype: Any = None, device: torch.device | str | None = None
) -> GPTModel:
    """Load a local Hugging Face model directory into the matching lmforge family.

    ``dtype`` (name or torch dtype) becomes the model's compute_dtype; by default the checkpoint's own
    ``dtype`` / ``torch_dtype`` from config.json, else float32.
    """
    path = Path(path)
    hf_cfg = _read_hf_config(path)
    try:
        cfg, cls = resolve(section_from_hf_config(hf_cfg, dtype))
    except ConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    sd = hf_state_dict(path, cfg)
    model = build_from_config(cfg, cls, "meta")
    model.to_empty(device=device or "cpu")
    model.init_weights()  # buffers and anything the checkpoint lacks (e.g. MTP layers)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith("mtp.")]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: tensors missing {missing[:8]} / unexpected {unexpected[:8]} after mapping."
        )
    return model


def hf_config_json(cfg: TransformerConfig) -> dict[str, Any]:
    """config.json for ``cfg`` that transformers 4.5x and 5.x both read the same way.

    transformers 5 reads the rope base and scaling from ``rope_parameters``; 4.x ignores that key and
    reads ``rope_theta`` / ``rope_scaling`` (and would silently fall back to base 10000 without them),
    so both forms are written. Likewise ``dtype`` (5.x) and ``torch_dtype`` (4.x).
    """
    hf_cfg = _adapter(cfg).hf_config(cfg)
    params = dict(hf_cfg.get("rope_parameters") or {})
    hf_cfg["rope_theta"] = float(params.pop("rope_theta", cfg.rope_theta))
    hf_cfg["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = dtype_name(cfg.compute_dtype)
    return hf_cfg


def save_hf_pretrained(
    model: GPTModel,
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write a directory that transformers' ``from_pretrained`` loads: config.json, sharded safetensors
    with ``model.safetensors.index.json``, and (with ``tokenizer``, a tokenizer.json or a directory
    holding one) the tokenizer files and generation_config.json. Returns the weight files written."""
    cfg = model.config
    limit = parse_size(max_shard_size)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    hf_sd = {k: v.contiguous().clone() for k, v in _adapter(cfg).to_hf(sd, cfg).items()}
    hf_cfg = hf_config_json(cfg)
    if tokenizer is not None:
        from lmforge.models.hf_tokenizer_files import write_tokenizer_files

        ids = write_tokenizer_files(tokenizer, path, cfg.max_position_embeddings, chat_template)
        hf_cfg.update({k: v for k, v in ids.items() if k != "pad_token_id"})
    elif chat_template is not None:
        raise ConfigError("a chat template needs a tokenizer to go with it; give the tokenizer too.")
    files = write_sharded(hf_sd, path, limit)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    return files
