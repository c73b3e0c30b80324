"""DeepseekV3ForCausalLM: the shared GPTModel built from a ``model_type: deepseek_v3`` section."""

from __future__ import annotations

from lmforge.models.common.gpt import GPTModel


class DeepseekV3ForCausalLM(GPTModel):
    model_type = "deepseek_v3"
