"""Tiny Hugging Face models (transformers' own classes, random init) for parity tests."""

from __future__ import annotations

import pytest
import torch

from tiny_fp32 import tiny_model, tiny_section

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def build_hf_model(family: str, **overrides):
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # large enough that a wrong layout shows in the logits
    )
    if family == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, **overrides)
        cls = tf.LlamaForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16, **overrides)
        cls = tf.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        kw = dict(
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
        )
        kw.update(overrides)
        cfg = tf.Qwen3MoeConfig(**common, **kw)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "deepseek_v3":
        kw = dict(
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=32,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=1,
            num_mtp_layers=0,
            rope_parameters=dict(YARN),
        )
        kw.update(overrides)
        cfg = tf.DeepseekV3Config(**common, **kw)
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    if family == "deepseek_v3":
        # HF initialises the routing bias to zero; make it matter so a dropped bias shows.
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def make_hf_model():
    return build_hf_model


@pytest.fixture(scope="session")
def tiny_model_section():
    """``tiny_model_section(family, **overrides)``: the ``model`` section ``tiny`` builds."""
    return tiny_section


@pytest.fixture(scope="session")
def tiny():
    """``tiny(family, **overrides)``: a tiny fp32 lmforge model (seeded; tests/tiny_fp32.py)."""
    return tiny_model
