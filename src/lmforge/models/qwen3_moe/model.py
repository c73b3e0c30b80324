"""Qwen3MoeForCausalLM: the shared GPTModel built from a ``model_type: qwen3_moe`` section."""

from __future__ import annotations

from lmforge.models.common.blocks import LayerBlocks, gqa_attention, moe_mlp
from lmforge.models.common.gpt import GPTModel


class Qwen3MoeForCausalLM(GPTModel):
    model_type = "qwen3_moe"
    blocks = LayerBlocks(attention=gqa_attention, mlp=moe_mlp)
