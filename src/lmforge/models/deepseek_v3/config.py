"""``model_type: deepseek_v3`` (DeepseekV3ForCausalLM): MLA + MoE with shared experts, sigmoid routing with
expert bias, group-limited top-k, dense first-k layers, optional MTP. ``deepseek_mtp`` is an alias."""

from __future__ import annotations

from lmforge.errors import ConfigError
from lmforge.models.common.config_keys import FamilyKeys
from lmforge.models.common.family_build import check_experts, common_fields, moe_balance, positive_int
from lmforge.models.common.section import FamilySection
from lmforge.models.common.transformer_config import TransformerConfig

KEYS = FamilyKeys(
    model_type="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    hf={
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": None,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_parameters": None,
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "aux_loss_alpha": None,
        "seq_aux": None,
        "ep_size": None,
    },
    moe=True,
    mla=True,
)


def to_transformer_config(values: FamilySection) -> TransformerConfig:
    if values.attention_bias:
        raise ConfigError("model.attention_bias = True is not supported for deepseek_v3 (MLA has no biases).")
    heads = values.num_attention_heads
    if values.num_key_value_heads not in (None, heads):
        raise ConfigError(
            f"model.num_key_value_heads = {values.num_key_value_heads!r}: multi-latent attention has one key "
            f"per head; leave it out or set it to num_attention_heads ({heads})."
        )
    common = common_fields(values, family_qk_norm=True, family_mla=True)
    num_layers = common["num_layers"]
    mtp = positive_int(values.num_nextn_predict_layers, "num_nextn_predict_layers", allow_zero=True)
    routed = values.n_routed_experts
    num_experts = positive_int(routed, "n_routed_experts", allow_zero=True) if routed else 0
    first_dense = positive_int(values.first_k_dense_replace, "first_k_dense_replace", allow_zero=True)
    freq = positive_int(values.moe_layer_freq, "moe_layer_freq")
    moe_layers = tuple(
        i for i in range(num_layers + mtp) if num_experts > 0 and i >= first_dense and i % freq == 0
    )
    top_k, n_group, topk_group = 1, 1, 1
    if num_experts:
        top_k = check_experts(values, "n_routed_experts", num_experts)
        n_group = positive_int(values.n_group, "n_group") if values.n_group is not None else 1
        topk_group = positive_int(values.topk_group, "topk_group") if values.topk_group is not None else 1
        if values.topk_method == "greedy":
            n_group, topk_group = 1, 1
        elif values.topk_method not in ("noaux_tc", "group_limited_greedy"):
            raise ConfigError(
                f"model.topk_method = {values.topk_method!r}; valid: 'noaux_tc', 'group_limited_greedy', 'greedy'."
            )
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ConfigError(
                f"model.n_group = {n_group} must divide n_routed_experts = {num_experts} and model.topk_group = "
                f"{topk_group} must be in [1, n_group]."
            )
        if top_k > topk_group * (num_experts // n_group):
            raise ConfigError(
                f"model.num_experts_per_tok = {top_k} exceeds the experts in the topk_group = {topk_group} kept "
                f"groups ({topk_group * (num_experts // n_group)})."
            )
    scoring = values.scoring_func or "sigmoid"
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"model.scoring_func = {scoring!r}; valid: 'sigmoid', 'softmax'.")
    # DeepSeek's own config names the sequence balance loss aux_loss_alpha (+ seq_aux).
    alpha = values.aux_loss_alpha
    per_sequence = values.seq_aux is not False
    default_type = ("seq_aux_loss" if per_sequence else "aux_loss") if alpha else "none"
    kind, coeff = moe_balance(values, default_type, float(alpha or 0.0))
    bias = values.moe_router_enable_expert_bias
    shared = values.moe_shared_expert_intermediate_size
    n_shared = (
        positive_int(values.n_shared_experts, "n_shared_experts", allow_zero=True)
        if values.n_shared_experts
        else 0
    )
    moe_ffn = positive_int(values.moe_intermediate_size, "moe_intermediate_size")
    # null or 0: no query LoRA (full-rank q projection); otherwise a positive rank.
    q_lora = None
    if values.q_lora_rank is not None:
        q_lora = positive_int(values.q_lora_rank, "q_lora_rank", allow_zero=True) or None
    cfg = TransformerConfig(
        model_type="deepseek_v3",
        architectures="DeepseekV3ForCausalLM",
        intermediate_size=positive_int(values.intermediate_size, "intermediate_size"),
        qk_norm=True,
        multi_latent_attention=True,
        q_lora_rank=q_lora,
        kv_lora_rank=positive_int(values.kv_lora_rank, "kv_lora_rank"),
        qk_nope_head_dim=positive_int(values.qk_nope_head_dim, "qk_nope_head_dim"),
        qk_rope_head_dim=positive_int(values.qk_rope_head_dim, "qk_rope_head_dim"),
        v_head_dim=positive_int(values.v_head_dim, "v_head_dim"),
        num_experts=num_experts,
        moe_layers=moe_layers,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_ffn,
        shared_expert_intermediate_size=int(shared) if shared is not None else n_shared * moe_ffn,
        routed_scaling_factor=float(values.routed_scaling_factor),
        n_group=n_group,
        topk_group=topk_group,
        group_score="max" if values.topk_method == "group_limited_greedy" else "top2_sum",
        norm_topk_prob=bool(values.norm_topk_prob),
        score_function=scoring,
        enable_expert_bias=True if bias is None else bool(bias),
        bias_update_rate=float(values.moe_router_bias_update_rate),
        load_balancing_type=kind,
        aux_loss_coeff=coeff,
        mtp_num_layers=mtp,
        mtp_loss_scaling_factor=float(values.mtp_loss_scaling_factor),
        hf_extra={"rope_interleave": bool(values.rope_interleave)},
        **common,
    )
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "yarn":
        cfg.rope_scaling.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    return cfg
