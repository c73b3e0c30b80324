"""Tensor + sequence parallel plan of a Qwen3 layer (the Llama plan; the per-head QK norms are replicated)."""

from __future__ import annotations

from lmforge.models.common.tp_plan import TPPlan, gqa_attention_plan, swiglu_plan
from lmforge.models.common.transformer_config import TransformerConfig


def tp_plan(cfg: TransformerConfig, layer_id: int) -> TPPlan:
    return {**gqa_attention_plan(cfg), **swiglu_plan(cfg.intermediate_size)}
