"""Tensor + sequence parallel plan of a Qwen3-MoE layer: GQA heads split; routed experts replicated on sequence shards."""

from __future__ import annotations

from lmforge.models.common.tp_plan import TPPlan, gqa_attention_plan, moe_plan
from lmforge.models.common.transformer_config import TransformerConfig


def tp_plan(cfg: TransformerConfig, layer_id: int) -> TPPlan:
    return {**gqa_attention_plan(cfg), **moe_plan(cfg, layer_id)}
