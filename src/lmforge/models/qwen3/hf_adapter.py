"""Qwen3 ↔ Hugging Face ``Qwen3ForCausalLM`` names: the Llama table plus the per-head QK norms

| Hugging Face                               | lmforge                                            |
|--------------------------------------------|----------------------------------------------------|
| model.layers.N.self_attn.q_norm.weight     | decoder.layers.N.self_attention.q_layernorm.weight |
| model.layers.N.self_attn.k_norm.weight     | decoder.layers.N.self_attention.k_layernorm.weight |
"""

from __future__ import annotations

from lmforge.models.common import hf_names as h
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.llama.hf_adapter import from_hf, to_hf

__all__ = ["from_hf", "hf_config", "to_hf"]


def hf_config(cfg: TransformerConfig) -> dict:
    return {
        **h.base_hf_config(cfg),
        "head_dim": cfg.head_dim,
        "attention_bias": cfg.attention_bias,
        "use_sliding_window": False,
    }
