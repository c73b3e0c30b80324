"""model_type → family (keys and config conversion); architectures → model class.

As in the original, ``model_type`` picks the configuration class and ``architectures`` (a string, or
the first element of a list) picks the model class; here the pair must also agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmforge.errors import ConfigError
from lmforge.models.common.config_keys import FamilyKeys, resolve_section
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.deepseek_v3 import DeepseekV3ForCausalLM
from lmforge.models.deepseek_v3 import config as deepseek_v3_config
from lmforge.models.llama import LlamaForCausalLM
from lmforge.models.llama import config as llama_config
from lmforge.models.qwen3 import Qwen3ForCausalLM
from lmforge.models.qwen3 import config as qwen3_config
from lmforge.models.qwen3_moe import Qwen3MoeForCausalLM
from lmforge.models.qwen3_moe import config as qwen3_moe_config


@dataclass(frozen=True)
class Family:
    keys: FamilyKeys
    to_transformer_config: Callable[[dict[str, Any]], TransformerConfig]


MODEL_TYPES: dict[str, Family] = {
    "llama": Family(llama_config.FAMILY, llama_config.to_transformer_config),
    "qwen3": Family(qwen3_config.FAMILY, qwen3_config.to_transformer_config),
    "qwen3_moe": Family(qwen3_moe_config.FAMILY, qwen3_moe_config.to_transformer_config),
    "deepseek_v3": Family(deepseek_v3_config.FAMILY, deepseek_v3_config.to_transformer_config),
}
MODEL_TYPE_ALIASES = {"deepseek_mtp": "deepseek_v3"}

ARCHITECTURES: dict[str, type[GPTModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def family_for(model_type: Any) -> Family:
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f"model.model_type is required (got {model_type!r}); known model types: {', '.join(sorted(MODEL_TYPES))}."
        )
    name = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if name not in MODEL_TYPES:
        raise ConfigError(
            f"model.model_type = {model_type!r} is not a known model type; known: "
            f"{', '.join(sorted([*MODEL_TYPES, *MODEL_TYPE_ALIASES]))}."
        )
    return MODEL_TYPES[name]


def architecture_name(raw: Any, family: Family) -> str:
    arch = raw[0] if isinstance(raw, (list, tuple)) and raw else raw
    if not isinstance(arch, str) or not arch:
        raise ConfigError(
            f"model.architectures is required (got {raw!r}); for model_type '{family.keys.model_type}' use "
            f"{' or '.join(family.keys.architectures)}."
        )
    if arch not in family.keys.architectures:
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"model.architectures = {arch!r} is not a known architecture; for model_type "
                f"'{family.keys.model_type}' use {' or '.join(family.keys.architectures)} (known: "
                f"{', '.join(sorted(ARCHITECTURES))})."
            )
        raise ConfigError(
            f"model.architectures = {arch!r} does not match model.model_type = '{family.keys.model_type}'; "
            f"use {' or '.join(family.keys.architectures)}."
        )
    return arch


def resolve(raw: dict[str, Any]) -> tuple[TransformerConfig, type[GPTModel]]:
    """Validate a plain ``model`` section; return its TransformerConfig and model class."""
    family = family_for(raw.get("model_type"))
    arch = architecture_name(raw.get("architectures"), family)
    values = resolve_section(raw, family.keys)
    cfg = family.to_transformer_config(values)
    cfg.section = dict(raw)
    return cfg, ARCHITECTURES[arch]
