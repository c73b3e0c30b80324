"""Reading and writing Hugging Face model directories (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmforge.errors import CheckpointError, ConfigError
from lmforge.models.build import build_from_config
from lmforge.models.common.config_keys import HF_BOOKKEEPING_KEYS
from lmforge.models.common.dtypes import dtype_name, parse_dtype
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.deepseek_v3 import hf_adapter as deepseek_v3_adapter
from lmforge.models.llama import hf_adapter as llama_adapter
from lmforge.models.lora import is_lora_param_name
from lmforge.models.qwen3 import hf_adapter as qwen3_adapter
from lmforge.models.qwen3_moe import hf_adapter as qwen3_moe_adapter
from lmforge.models.registry import family_for, resolve
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.models")

ADAPTERS: dict[str, ModuleType] = {
    "llama": llama_adapter,
    "qwen3": qwen3_adapter,
    "qwen3_moe": qwen3_moe_adapter,
    "deepseek_v3": deepseek_v3_adapter,
}


def section_from_hf_config(hf_cfg: dict[str, Any], dtype: Any = None) -> dict[str, Any]:
    """A lmforge ``model`` section equivalent to a Hugging Face config.json (unknown keys dropped, warned)."""
    family = family_for(hf_cfg.get("model_type"))
    adapter = ADAPTERS[family.keys.model_type]
    valid = set(family.keys.valid_keys())
    section: dict[str, Any] = {}
    dropped = []
    renames = getattr(adapter, "HF_RENAMES", {})
    for key, value in hf_cfg.items():
        key = renames.get(key, key)
        if key in adapter.HF_DERIVED_KEYS or key in HF_BOOKKEEPING_KEYS:
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
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; lmforge reads Hugging Face "
            "checkpoints in safetensors format only."
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file} is listed in the safetensors index but does not exist.")
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = f.get_tensor(key)
    return tensors


def hf_state_dict(path: str | Path, cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory under lmforge names, for a model of ``cfg``."""
    path = Path(path)
    hf_sd = read_safetensors_dir(path)
    sd = ADAPTERS[cfg.model_type].from_hf(hf_sd, cfg)
    leftover = sorted(k for k in hf_sd if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        _log.warning("%s: %d tensors not used: %s", path, len(leftover), ", ".join(leftover[:8]))
    return sd


def load_hf_weights(model: GPTModel, path: str | Path) -> None:
    """Load a Hugging Face directory's weights into an existing lmforge model (the trainer's ``hf_loader``).

    The directory's config.json must describe the same structure as ``model.config``. Works on sharded
    (DTensor) models too: the full tensors are distributed by ``set_model_state_dict``.
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
    sd = hf_state_dict(path, ours)
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # MTP layers and LoRA adapters (lmforge.models.lora) are not in a Hugging Face base model.
    missing = [k for k in missing if not k.startswith("mtp.") and not is_lora_param_name(k)]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: tensors missing {missing[:8]} / unexpected {unexpected[:8]} after mapping."
        )


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


def save_hf_pretrained(model: GPTModel, path: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers' ``from_pretrained`` loads."""
    cfg = model.config
    adapter = ADAPTERS[cfg.model_type]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    hf_sd = {k: v.contiguous().clone() for k, v in adapter.to_hf(sd, cfg).items()}
    hf_cfg = adapter.hf_config(cfg)
    hf_cfg["dtype"] = dtype_name(cfg.compute_dtype)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    save_file(hf_sd, str(path / "model.safetensors"), metadata={"format": "pt"})
