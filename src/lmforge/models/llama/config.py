"""``model_type: llama`` (LlamaForCausalLM): GQA, RoPE (optionally Llama-3 / linear / YaRN scaled), SwiGLU."""

from __future__ import annotations

from lmforge.models.common.config_keys import FamilyKeys
from lmforge.models.common.family_build import common_fields, positive_int
from lmforge.models.common.section import FamilySection
from lmforge.models.common.transformer_config import TransformerConfig

KEYS = FamilyKeys(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    hf={
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_parameters": None,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
    },
)


def to_transformer_config(values: FamilySection) -> TransformerConfig:
    return TransformerConfig(
        model_type="llama",
        architectures="LlamaForCausalLM",
        intermediate_size=positive_int(values.intermediate_size, "intermediate_size"),
        attention_bias=bool(values.attention_bias),
        mlp_bias=bool(values.mlp_bias),
        **common_fields(values, family_qk_norm=False, family_mla=False),
    )
