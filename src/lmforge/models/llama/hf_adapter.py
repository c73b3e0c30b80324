"""Llama ↔ Hugging Face ``LlamaForCausalLM`` names.

| Hugging Face                                        | lmforge                                              |
|-----------------------------------------------------|------------------------------------------------------|
| model.embed_tokens.weight                           | embedding.word_embeddings.weight                     |
| model.layers.N.input_layernorm.weight               | decoder.layers.N.input_layernorm.weight              |
| model.layers.N.self_attn.{q,k,v}_proj.weight (bias) | decoder.layers.N.self_attention.linear_qkv.weight (rows per kv group [q; k; v]) |
| model.layers.N.self_attn.o_proj.weight (bias)       | decoder.layers.N.self_attention.linear_proj.weight   |
| model.layers.N.post_attention_layernorm.weight      | decoder.layers.N.pre_mlp_layernorm.weight            |
| model.layers.N.mlp.{gate,up}_proj.weight (bias)     | decoder.layers.N.mlp.linear_fc1.weight (gate/up row pairs) |
| model.layers.N.mlp.down_proj.weight (bias)          | decoder.layers.N.mlp.linear_fc2.weight               |
| model.norm.weight                                   | decoder.final_layernorm.weight                       |
| lm_head.weight (absent when tied)                   | output_layer.weight                                  |
"""

from __future__ import annotations

from lmforge.models.common import hf_names as h
from lmforge.models.common.transformer_config import TransformerConfig


def from_hf(hf: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_from_hf(hf, cfg, out)
    for i in range(cfg.num_layers):
        hp, lp = h.HF.format(i=i), h.LM.format(i=i)
        h.norms_from_hf(hf, hp, lp, out)
        h.gqa_attention_from_hf(hf, hp, lp, cfg, out)
        h.swiglu_from_hf(hf, f"{hp}mlp.", f"{lp}mlp.", out, bias=cfg.mlp_bias)
    return out


def to_hf(sd: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_to_hf(sd, cfg, out)
    for i in range(cfg.num_layers):
        hp, lp = h.HF.format(i=i), h.LM.format(i=i)
        h.norms_to_hf(sd, hp, lp, out)
        h.gqa_attention_to_hf(sd, hp, lp, cfg, out)
        h.swiglu_to_hf(sd, f"{hp}mlp.", f"{lp}mlp.", out, bias=cfg.mlp_bias)
    return out


def hf_config(cfg: TransformerConfig) -> dict:
    return {
        **h.base_hf_config(cfg),
        "head_dim": cfg.head_dim,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
    }
