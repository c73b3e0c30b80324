"""Tensor + sequence parallel plan of a DeepSeek-V3 layer: MLA up projections split per head (latent down projections replicated); shared experts split, routed experts replicated on sequence shards."""

from __future__ import annotations

from lmforge.models.common.tp_plan import TPPlan, mla_attention_plan, moe_plan
from lmforge.models.common.transformer_config import TransformerConfig


def tp_plan(cfg: TransformerConfig, layer_id: int) -> TPPlan:
    return {**mla_attention_plan(cfg), **moe_plan(cfg, layer_id)}
