"""Reading and writing Hugging Face model directories (config.json + safetensors, sharded or not;
tokenizer files and generation_config.json on export)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import CheckpointError, ConfigError
from lmforge.models.build import build_from_config
from lmforge.models.common.config_keys import HF_BOOKKEEPING_KEYS
from lmforge.models.common.dtypes import dtype_name, parse_dtype
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.family import HFAdapter
from lmforge.models.hf_checks import check_hf_tensors, check_unused, expected_hf_shapes, open_safetensors
from lmforge.models.hf_read import load_per_rank, weight_files
from lmforge.models.hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_size, write_sharded
from lmforge.models.pretrained import numerics_differences
from lmforge.models.registry import family_for, resolve
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.models")


def _adapter(cfg: TransformerConfig) -> HFAdapter:
    return family_for(cfg.model_type).hf_adapter


# config.json keys that the export writes itself (never carried over from the imported file).
_WRITTEN_ON_EXPORT = ("model_type", "architectures", "dtype", "torch_dtype", "transformers_version")
# The model-section key holding the config.json keys lmforge does not model, written back on export.
HF_CONFIG_KEY = "hf_config"


def section_from_hf_config(hf_cfg: dict[str, Any], dtype: Any = None) -> dict[str, Any]:
    """A lmforge ``model`` section equivalent to a Hugging Face config.json.

    Keys lmforge does not model (token ids, ``use_cache``, keys of other libraries) go under
    ``hf_config`` so that an export writes them back unchanged; those that are not bookkeeping are
    warned about, as they may change what the original model computes."""
    family = family_for(hf_cfg.get("model_type"))
    adapter = family.hf_adapter
    valid = set(family.keys.valid_keys())
    section: dict[str, Any] = {}
    carried: dict[str, Any] = {}
    renames = adapter.renames
    for name, value in hf_cfg.items():
        key = renames.get(name, name)
        if key in adapter.derived_keys or name in _WRITTEN_ON_EXPORT:
            continue
        if key in valid and key not in HF_BOOKKEEPING_KEYS:
            section[key] = value
        else:
            carried[name] = value
    unknown = sorted(k for k in carried if k not in HF_BOOKKEEPING_KEYS)
    if unknown:
        _log.warning(
            "config.json keys not used by lmforge's %s (kept for the export): %s",
            family.keys.model_type,
            ", ".join(unknown),
        )
    section["model_type"] = family.keys.model_type
    archs = hf_cfg.get("architectures") or list(family.keys.architectures)
    section["architectures"] = archs[0] if isinstance(archs, list) else archs
    chosen = dtype if dtype is not None else hf_cfg.get("dtype", hf_cfg.get("torch_dtype")) or "float32"
    section["compute_dtype"] = dtype_name(parse_dtype(chosen, "dtype"))
    if carried:
        section[HF_CONFIG_KEY] = carried
    return section


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory, whole (one process; ``load_hf_weights`` reads per rank instead)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(path).items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        for file, names in by_file.items():
            handle = open_safetensors(file, stack)
            for key in names:
                tensors[key] = handle.get_tensor(key)
    return tensors


def hf_state_dict(path: str | Path, cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory under lmforge names, for a model of ``cfg``; a tensor the
    model does not use is refused (config.json and the weights disagree)."""
    path = Path(path)
    hf_sd = read_safetensors_dir(path)
    sd = _adapter(cfg).from_hf(hf_sd, cfg)
    check_unused(path, hf_sd)  # what from_hf did not take
    return sd


def check_against_config(path: Path, cfg: TransformerConfig, cls: type[GPTModel]) -> None:
    """Refuse, from the headers alone, a directory whose tensors are not floating point or do not have
    the shapes of the model of ``cfg`` (lmforge.models.hf_checks)."""
    meta = build_from_config(cfg, cls, "meta")
    expected = expected_hf_shapes(meta, cfg, _adapter(cfg).to_hf)
    check_hf_tensors(path, weight_files(path), expected)


def load_hf_weights(model: GPTModel, path: str | Path) -> None:
    """Load a Hugging Face directory's weights into an existing lmforge model (the trainer's ``hf_loader``).

    The directory's config.json must describe the same structure as ``model.config``. Works on sharded
    (DTensor) models and pipeline stages too: each rank reads only the rows and columns of its own
    shards (``lmforge.models.hf_read``), never the whole model.
    """
    path = Path(path)
    hf_cfg = _read_hf_config(path)
    try:
        theirs = resolve(section_from_hf_config(hf_cfg, model.config.compute_dtype))
    except ConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    ours = model.config
    diff = [f"{f}: checkpoint {a!r} vs model {b!r}" for f, a, b in numerics_differences(theirs.config, ours)]
    if diff:
        raise CheckpointError(
            f"{path} is a different model than the model section: {'; '.join(diff[:4])}. Make the model section "
            "match the checkpoint's config.json, or take it from there with model: {from_pretrained: "
            f"{path}}} (docs/models.md)."
        )
    check_against_config(path, ours, theirs.model_class)
    load_per_rank(model, path, ours, _adapter(ours).from_hf)


def restore_interrupted_publish(path: Path) -> None:
    """Put back ``path`` from ``.NAME.old`` when an export was killed between its two publishing renames.
    Every rank of a run may try at once: one rename wins, the others find the directory in place."""
    from lmforge.utils.atomic import recover_dir

    with contextlib.suppress(FileNotFoundError):  # another process restored it first
        recover_dir(path)


def _read_hf_config(path: Path) -> dict[str, Any]:
    restore_interrupted_publish(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} does not exist; expected a Hugging Face model directory.")
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{cfg_file} must hold a JSON object (the model's config), got {type(data).__name__}."
        )
    return data


def hf_compute_dtype(path: str | Path) -> str:
    """The compute dtype a Hugging Face directory's config.json names (``dtype`` / ``torch_dtype``; float32
    when it names none)."""
    hf_cfg = _read_hf_config(Path(path))
    chosen = hf_cfg.get("dtype", hf_cfg.get("torch_dtype")) or "float32"
    try:
        return dtype_name(parse_dtype(chosen, "dtype"))
    except ConfigError as exc:
        raise CheckpointError(f"{Path(path) / 'config.json'}: {exc}") from None


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
        typed = resolve(section_from_hf_config(hf_cfg, dtype))
    except ConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    cfg, cls = typed.config, typed.model_class
    check_against_config(path, cfg, cls)
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


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def hf_config_json(cfg: TransformerConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """config.json for ``cfg`` that transformers 4.5x and 5.x both read the same way.

    transformers 5 reads the rope base and scaling from ``rope_parameters``; 4.x ignores that key and
    reads ``rope_theta`` / ``rope_scaling`` (and would silently fall back to base 10000 without them),
    so both forms are written. Likewise ``dtype`` (5.x) and ``torch_dtype`` (4.x): ``dtype`` when
    given (the dtype the weights are written in), else the compute dtype.
    """
    carried = cfg.section.get(HF_CONFIG_KEY)
    carried = dict(carried) if isinstance(carried, dict) else {}
    # Hugging Face keys the section holds that the adapter does not write (sliding_window, layer_types)
    # go back as given; what the adapter writes comes from the validated structure.
    family_keys = family_for(cfg.model_type).keys.hf
    carried.update({k: v for k, v in cfg.section.items() if k in family_keys})
    hf_cfg = {**carried, **_adapter(cfg).hf_config(cfg)}
    params = dict(hf_cfg.get("rope_parameters") or {})
    hf_cfg["rope_theta"] = float(params.pop("rope_theta", cfg.rope_theta))
    hf_cfg["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = dtype_name(dtype or cfg.compute_dtype)
    return hf_cfg


def save_hf_pretrained(
    model: GPTModel,
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write a directory that transformers' ``from_pretrained`` loads: config.json, sharded safetensors
    with ``model.safetensors.index.json``, and (with ``tokenizer``, a tokenizer.json or a directory
    holding one) the tokenizer files and generation_config.json. Returns the weight files written.

    ``dtype``: every floating tensor is written in it (cast once, from the model's own values: a model
    holding the fp32 masters exports them in full, or rounds them once); default: as they are."""
    cfg = model.config
    limit = parse_size(max_shard_size)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    hf_sd = {k: _cast(v, dtype).contiguous().clone() for k, v in _adapter(cfg).to_hf(sd, cfg).items()}
    hf_cfg = hf_config_json(cfg, dtype)
    if tokenizer is not None:
        from lmforge.models.hf_tokenizer_files import write_tokenizer_files

        ids = write_tokenizer_files(tokenizer, path, cfg.max_position_embeddings, chat_template)
        # The tokenizer's ids, unless the imported config.json named its own (kept as they were).
        hf_cfg.update({k: v for k, v in ids.items() if k != "pad_token_id" and k not in hf_cfg})
    elif chat_template is not None:
        raise ConfigError("a chat template needs a tokenizer to go with it; give the tokenizer too.")
    files = write_sharded(hf_sd, path, limit)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    return files
