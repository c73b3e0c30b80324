"""Tiny fp32 lmforge models (one place for their sections: the model tests' conftest fixtures use them too,
and tests/tiny_train_config.py's training runs take theirs from :func:`tiny_run_model`)."""

from __future__ import annotations

import torch

from lmforge.config import validate_section
from lmforge.models import build_model

TINY_SECTIONS = {
    "llama": {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "num_key_value_heads": 2,
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": "Qwen3ForCausalLM",
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "architectures": "DeepseekV3ForCausalLM",
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 0,
    },
}


def tiny_section(family: str, **overrides) -> dict:
    """The ``model`` section of a tiny fp32 model of ``family``."""
    return {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "compute_dtype": "float32",
        "initializer_range": 0.1,
        **TINY_SECTIONS[family],
        **overrides,
    }


# The 2-layer Qwen3 of the tests' short training runs (tests/tiny_train_config.py): smaller than tiny_section's,
# for runs of tens of steps on a 64-token vocabulary. Its callers set seq_length and compute_dtype.
TINY_RUN_MODEL = {
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 64,
}


def tiny_run_model(**overrides) -> dict:
    """The ``model`` section of the tiny training runs (``TINY_RUN_MODEL`` with ``overrides``)."""
    return {**TINY_RUN_MODEL, **overrides}


def tiny_model(family: str = "qwen3", **overrides):
    torch.manual_seed(0)
    return build_model(validate_section("model", tiny_section(family, **overrides))).eval()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()
