from lmforge.models.llama.model import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
