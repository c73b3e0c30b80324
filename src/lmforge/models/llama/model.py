"""LlamaForCausalLM: the shared GPTModel built from a ``model_type: llama`` section."""

from __future__ import annotations

from lmforge.models.common.blocks import LayerBlocks, gqa_attention, swiglu_mlp
from lmforge.models.common.gpt import GPTModel


class LlamaForCausalLM(GPTModel):
    model_type = "llama"
    blocks = LayerBlocks(attention=gqa_attention, mlp=swiglu_mlp)
