"""``model: {from_pretrained: DIR}``: the model section taken from a Hugging Face directory's config.json.

The section becomes what ``lmforge convert --from-hf`` would write for DIR (the structure, rope
settings, norms, token ids under ``hf_config``) with ``compute_dtype: auto`` (config.json's dtype is
how the weights are stored), and the keys the YAML gives beside ``from_pretrained`` are laid over it. Keys that only say how to train or compute (``compute_dtype``, ``seq_length``,
dropout, initialisation, loss chunks, auxiliary-loss weights) may differ from config.json; a key that
changes what the model computes (its shapes, ``rope_theta``, ``rope_scaling``, ``rms_norm_eps``,
``max_position_embeddings``, ...) must agree with it, or the load is refused naming both values: a
model trained with other numerics than its weights were made for would fit silently worse.

The same comparison guards ``checkpoint.load_path`` pointing at a Hugging Face directory while the
model section is written out in the YAML (``hf_io.load_hf_weights``). The weights themselves come
from ``checkpoint.load_path`` (docs/models.md); ``from_pretrained`` describes the model only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError
from lmforge.models.common.config_keys import ALIASES, rope_settings
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.utils.native_dtype import AUTO

# TransformerConfig fields that say how a run trains or computes, not what the model is: a YAML may
# set them to anything whatever config.json says.
TRAINING_FIELDS = frozenset(
    {
        "compute_dtype",
        "compute_dtype_auto",
        "params_dtype",
        "seq_length",
        "loss_chunk_size",
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "aux_loss_coeff",
        "bias_update_rate",
        "load_balancing_type",
        "mtp_loss_scaling_factor",
        "section",
    }
)


_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_base", "position_embedding_type")


def numerics_differences(theirs: TransformerConfig, ours: TransformerConfig) -> list[tuple[str, Any, Any]]:
    """``(field, theirs, ours)`` for every field that changes what the model computes and differs."""
    out = []
    for f in dataclasses.fields(TransformerConfig):
        if f.name in TRAINING_FIELDS:
            continue
        a, b = getattr(theirs, f.name), getattr(ours, f.name)
        if a != b:
            out.append((f.name, a, b))
    return out


def _canonical(key: str, valid: list[str]) -> str:
    """The key a YAML alias (``num_layers``, ``rotary_base``, ...) stands for in config.json's terms."""
    return next((t for t in ALIASES.get(key, ()) if t in valid), key)


def expand_from_pretrained(data: Any) -> Any:
    """The model section ``data`` with ``from_pretrained: DIR`` replaced by DIR's config.json (see the
    module docstring); any other ``data`` unchanged. Raises ``ConfigError`` naming ``model.*`` keys."""
    if not isinstance(data, dict) or "from_pretrained" not in data:
        return data
    from lmforge.models.hf_io import HF_CONFIG_KEY, section_from_hf_config
    from lmforge.models.registry import family_for, resolve

    where = data["from_pretrained"]
    if not isinstance(where, str) or not where:
        raise ConfigError(
            f"model.from_pretrained = {where!r} must be the path of a Hugging Face model directory "
            "(one holding config.json)."
        )
    hf_cfg = _read_config_json(Path(where))
    try:
        base = section_from_hf_config(hf_cfg)
    except ConfigError as exc:
        raise ConfigError(f"model.from_pretrained: {where}/config.json: {exc}") from None
    given = {k: v for k, v in data.items() if k not in ("from_pretrained", HF_CONFIG_KEY)}
    for key in ("model_type", "architectures"):
        if key in given and given[key] != base[key]:
            raise ConfigError(
                f"model.{key} = {given[key]!r} disagrees with {where}/config.json ({base[key]!r}); drop "
                f"model.{key} (from_pretrained takes it from config.json) or point from_pretrained elsewhere."
            )
    valid = family_for(base["model_type"]).keys.valid_keys()
    # config.json's dtype says how the weights are stored, not how to train: the device's native choice
    # unless the YAML sets compute_dtype.
    try:
        typed_base = resolve(base)
    except ConfigError as exc:
        raise ConfigError(f"model.from_pretrained: {where}/config.json: {exc}") from None
    merged = {**base, "compute_dtype": AUTO}
    if any(k in given for k in _ROPE_KEYS):  # config.json's rope settings in the keys the YAML uses
        merged.pop("rope_parameters", None)
        theta, scaling = rope_settings(typed_base.section)
        merged.update(rope_theta=theta, rope_scaling=scaling)
    for key in given:
        merged.pop(_canonical(key, valid), None)  # the YAML's alias replaces config.json's key
    merged.update(given)
    ours = resolve(merged).config
    diff = numerics_differences(typed_base.config, ours)
    if diff:
        named = "; ".join(f"model.{f}: the YAML gives {b!r}, config.json {a!r}" for f, a, b in diff[:4])
        raise ConfigError(
            f"model.from_pretrained = {where}: the model section changes what the pretrained model computes "
            f"({named}). Remove these keys to take config.json's values, or point from_pretrained at the "
            "model you mean; only training settings (compute_dtype, seq_length, dropout, ...) may differ."
        )
    # The complete section, without from_pretrained: the config.yaml a run saves with its checkpoints
    # rebuilds the model without DIR (which may have moved by the time the checkpoint is evaluated).
    return merged


def _read_config_json(path: Path) -> dict[str, Any]:
    from lmforge.models.hf_io import restore_interrupted_publish

    restore_interrupted_publish(path)
    cfg_file = path / "config.json"
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"model.from_pretrained = {path}: {cfg_file} does not exist; give a Hugging Face model directory "
            "(config.json with its safetensors files)."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"model.from_pretrained = {path}: {cfg_file} is not readable JSON ({exc})."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.from_pretrained = {path}: {cfg_file} must hold a JSON object.")
    return data
