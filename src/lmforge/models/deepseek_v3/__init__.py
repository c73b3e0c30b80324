from lmforge.models.deepseek_v3.model import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3ForCausalLM"]
