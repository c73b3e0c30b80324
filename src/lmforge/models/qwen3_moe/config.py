"""``model_type: qwen3_moe`` (Qwen3MoeForCausalLM): Qwen3 attention, softmax top-k MoE without shared experts."""

from __future__ import annotations

from lmforge.models.common.config_keys import FamilyKeys
from lmforge.models.common.family_build import check_experts, common_fields, moe_balance, positive_int
from lmforge.models.common.section import FamilySection
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.qwen3.config import QWEN3_ATTENTION_KEYS, check_full_attention

KEYS = FamilyKeys(
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    hf={
        **QWEN3_ATTENTION_KEYS,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "head_dim": None,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None,
    },
    moe=True,
)


def to_transformer_config(values: FamilySection) -> TransformerConfig:
    check_full_attention(values)
    common = common_fields(values, family_qk_norm=True, family_mla=False)
    num_experts = positive_int(values.num_experts, "num_experts", allow_zero=True)
    step = positive_int(values.decoder_sparse_step, "decoder_sparse_step")
    only_dense = set(values.mlp_only_layers or [])
    moe_layers = tuple(
        i
        for i in range(common["num_layers"])
        if num_experts > 0 and i not in only_dense and (i + 1) % step == 0
    )
    top_k = check_experts(values, "num_experts", num_experts) if num_experts else 1
    # Hugging Face adds router_aux_loss_coef × the Switch loss only with output_router_logits; same default here.
    default_type = "aux_loss" if values.output_router_logits else "none"
    kind, coeff = moe_balance(values, default_type, float(values.router_aux_loss_coef))
    bias = values.moe_router_enable_expert_bias
    return TransformerConfig(
        model_type="qwen3_moe",
        architectures="Qwen3MoeForCausalLM",
        intermediate_size=positive_int(values.intermediate_size, "intermediate_size"),
        attention_bias=bool(values.attention_bias),
        qk_norm=True,
        num_experts=num_experts,
        moe_layers=moe_layers,
        num_experts_per_tok=top_k,
        moe_intermediate_size=positive_int(values.moe_intermediate_size, "moe_intermediate_size"),
        shared_expert_intermediate_size=int(values.moe_shared_expert_intermediate_size or 0),
        norm_topk_prob=bool(values.norm_topk_prob),
        score_function="softmax",
        enable_expert_bias=bool(bias),
        bias_update_rate=float(values.moe_router_bias_update_rate),
        load_balancing_type=kind,
        aux_loss_coeff=coeff,
        **common,
    )
