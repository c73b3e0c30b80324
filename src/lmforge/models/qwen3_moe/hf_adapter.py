"""Qwen3-MoE ↔ Hugging Face ``Qwen3MoeForCausalLM`` names: the Qwen3 table, and in MoE layers

| Hugging Face                                          | lmforge                                            |
|-------------------------------------------------------|----------------------------------------------------|
| model.layers.N.mlp.gate.weight                        | decoder.layers.N.mlp.router.weight (fp32)          |
| model.layers.N.mlp.experts.E.{gate,up}_proj.weight    | decoder.layers.N.mlp.experts.linear_fc1.weight[E] (gate/up row pairs) |
| model.layers.N.mlp.experts.E.down_proj.weight         | decoder.layers.N.mlp.experts.linear_fc2.weight[E]  |

(transformers 5's in-memory fused ``experts.gate_up_proj`` / ``experts.down_proj`` are read too.)
"""

from __future__ import annotations

from lmforge.errors import CheckpointError
from lmforge.models.common import hf_names as h
from lmforge.models.common.transformer_config import TransformerConfig

# transformers 5 writes the expert count under its attribute-map name.
HF_RENAMES = {"num_local_experts": "num_experts"}


def from_hf(hf: dict, cfg: TransformerConfig) -> dict:
    out: dict = {}
    h.embeddings_from_hf(hf, cfg, out)
    for i in range(cfg.num_layers):
        hp, lp = h.HF.format(i=i), h.LM.format(i=i)
        h.norms_from_hf(hf, hp, lp, out)
        h.gqa_attention_from_hf(hf, hp, lp, cfg, out)
        if cfg.is_moe_layer(i):
            out[f"{lp}mlp.router.weight"] = h.take(hf, f"{hp}mlp.gate.weight")
            h.experts_from_hf(hf, f"{hp}mlp.", f"{lp}mlp.", cfg.num_experts, out)
        else:
            h.swiglu_from_hf(hf, f"{hp}mlp.", f"{lp}mlp.", out)
    return out


def to_hf(sd: dict, cfg: TransformerConfig) -> dict:
    if cfg.shared_expert_intermediate_size:
        raise CheckpointError(
            "Qwen3MoeForCausalLM has no shared experts; a qwen3_moe model with "
            "moe_shared_expert_intermediate_size cannot be written as a Hugging Face checkpoint."
        )
    out: dict = {}
    h.embeddings_to_hf(sd, cfg, out)
    for i in range(cfg.num_layers):
        hp, lp = h.HF.format(i=i), h.LM.format(i=i)
        h.norms_to_hf(sd, hp, lp, out)
        h.gqa_attention_to_hf(sd, hp, lp, cfg, out)
        if cfg.is_moe_layer(i):
            out[f"{hp}mlp.gate.weight"] = sd[f"{lp}mlp.router.weight"]
            h.experts_to_hf(sd, f"{hp}mlp.", f"{lp}mlp.", out)
        else:
            h.swiglu_to_hf(sd, f"{hp}mlp.", f"{lp}mlp.", out)
    return out


def hf_config(cfg: TransformerConfig) -> dict:
    moe = set(cfg.moe_layers)
    return {
        **h.base_hf_config(cfg),
        "head_dim": cfg.head_dim,
        "attention_bias": cfg.attention_bias,
        "use_sliding_window": False,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in moe],
        "router_aux_loss_coef": cfg.aux_loss_coeff,
        "output_router_logits": cfg.load_balancing_type != "none" and cfg.aux_loss_coeff > 0,
    }
