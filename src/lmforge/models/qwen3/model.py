"""Qwen3ForCausalLM: the shared GPTModel built from a ``model_type: qwen3`` section."""

from __future__ import annotations

from lmforge.models.common.blocks import LayerBlocks, gqa_attention, swiglu_mlp
from lmforge.models.common.gpt import GPTModel


class Qwen3ForCausalLM(GPTModel):
    model_type = "qwen3"
    blocks = LayerBlocks(attention=gqa_attention, mlp=swiglu_mlp)
