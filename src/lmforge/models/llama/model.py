"""LlamaForCausalLM: the shared GPTModel built from a ``model_type: llama`` section."""

from __future__ import annotations

from lmforge.models.common.gpt import GPTModel


class LlamaForCausalLM(GPTModel):
    model_type = "llama"
