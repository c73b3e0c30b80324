"""``model_type: qwen3`` (Qwen3ForCausalLM): GQA with per-head QK RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

from typing import Any

from lmforge.models.common.config_keys import FamilyKeys, require_value
from lmforge.models.common.family_build import common_fields, positive_int
from lmforge.models.common.section import FamilySection
from lmforge.models.common.transformer_config import TransformerConfig

QWEN3_ATTENTION_KEYS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": None,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": None,
    "layer_types": None,
}

KEYS = FamilyKeys(model_type="qwen3", architectures=("Qwen3ForCausalLM",), hf=dict(QWEN3_ATTENTION_KEYS))


def check_full_attention(values: FamilySection) -> None:
    require_value(
        values.use_sliding_window,
        "use_sliding_window",
        (False,),
        "sliding-window attention is not implemented",
    )
    layer_types = values.layer_types
    if layer_types and any(t != "full_attention" for t in layer_types):
        from lmforge.errors import ConfigError

        raise ConfigError(
            "model.layer_types contains a type other than 'full_attention'; only full attention is supported."
        )


def to_transformer_config(values: FamilySection) -> TransformerConfig:
    check_full_attention(values)
    return TransformerConfig(
        model_type="qwen3",
        architectures="Qwen3ForCausalLM",
        intermediate_size=positive_int(values.intermediate_size, "intermediate_size"),
        attention_bias=bool(values.attention_bias),
        qk_norm=True,
        **common_fields(values, family_qk_norm=True, family_mla=False),
    )
