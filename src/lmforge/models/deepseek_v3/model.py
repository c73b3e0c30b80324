"""DeepseekV3ForCausalLM: the shared GPTModel built from a ``model_type: deepseek_v3`` section."""

from __future__ import annotations

from lmforge.models.common.blocks import LayerBlocks, mla_attention, moe_mlp
from lmforge.models.common.gpt import GPTModel


class DeepseekV3ForCausalLM(GPTModel):
    model_type = "deepseek_v3"
    blocks = LayerBlocks(attention=mla_attention, mlp=moe_mlp)
