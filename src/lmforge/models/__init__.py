"""Model families (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3), their registry and Hugging Face interchange.

* ``build_model(section, device=None)`` / ``build_model_config(section)``: see ``build.py``.
* ``load_hf_pretrained(path, dtype=None)`` / ``save_hf_pretrained(model, path)``: see ``hf_io.py``;
  ``load_hf_weights(model, path)`` fills an existing model (the trainer's ``hf_loader``).
* ``save_model_checkpoint`` / ``load_model_checkpoint``: the model-only checkpoint ``lmforge convert`` writes.
"""

from lmforge.models.build import build_model, build_model_config
from lmforge.models.common.gpt import CausalLMOutput, GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.hf_io import load_hf_pretrained, load_hf_weights, save_hf_pretrained
from lmforge.models.io import load_model_checkpoint, save_model_checkpoint
from lmforge.models.registry import ARCHITECTURES, MODEL_TYPES

__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "CausalLMOutput",
    "GPTModel",
    "TransformerConfig",
    "build_model",
    "build_model_config",
    "load_hf_pretrained",
    "load_hf_weights",
    "load_model_checkpoint",
    "save_hf_pretrained",
    "save_model_checkpoint",
]
