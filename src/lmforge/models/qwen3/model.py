"""Qwen3ForCausalLM: the shared GPTModel built from a ``model_type: qwen3`` section."""

from __future__ import annotations

from lmforge.models.common.gpt import GPTModel


class Qwen3ForCausalLM(GPTModel):
    model_type = "qwen3"
