from lmforge.models.qwen3.model import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM"]
