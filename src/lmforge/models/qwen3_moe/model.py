"""Qwen3MoeForCausalLM: the shared GPTModel built from a ``model_type: qwen3_moe`` section."""

from __future__ import annotations

from lmforge.models.common.gpt import GPTModel


class Qwen3MoeForCausalLM(GPTModel):
    model_type = "qwen3_moe"
