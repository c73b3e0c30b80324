"""The keys of a ``model`` section: per family, the original's, aliases, bookkeeping; rope settings.

A family declares its Hugging Face structure keys with defaults (``FamilyKeys.hf``); every family also
accepts the original's own keys that apply to it (``COMMON_MF_KEYS``, ``MOE_MF_KEYS``, ``MLA_MF_KEYS``)
and the bookkeeping keys a Hugging Face ``config.json`` carries (token ids, ``use_cache`` ...). These
tables are what ``models/common/section.py`` makes the family's typed (pydantic) schema from; any other
key is an error naming ``model.<key>`` and listing the valid keys: the original silently ignores typos.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from lmforge.config.inert import inert_fields
from lmforge.errors import ConfigError

# Keys accepted so that the original's files load, with no effect here: their one table is
# lmforge.config.inert.INERT_FIELDS (which warns at load); the key tables below only give defaults.
_INERT = inert_fields("model")


def _no_effect(key: str) -> str:
    return f"no effect: {_INERT[key]}"


# The original's keys every family accepts. Value: (default, meaning for docs).
COMMON_MF_KEYS: dict[str, tuple[Any, str]] = {
    "seq_length": (4096, "default sequence length for flops_per_token (the data section sets the real one)"),
    "compute_dtype": (
        "bfloat16",
        "dtype of parameters and activations; auto: bf16 where the device computes it natively, else float32",
    ),
    "params_dtype": ("float32", "dtype of the optimizer's master weights (exposed as model.params_dtype)"),
    "layernorm_compute_dtype": ("float32", "RMSNorm computes in fp32; only float32 is accepted"),
    "softmax_compute_dtype": ("float32", "softmax runs in fp32 inside SDPA; only float32 is accepted"),
    "rotary_dtype": ("float32", "RoPE angles are fp32; only float32 is accepted"),
    "use_flash_attention": (True, "attention always uses the fused scaled_dot_product_attention"),
    "hidden_act": ("silu", "silu / swiglu / fusedswiglu: all mean the SwiGLU MLP"),
    "add_bias_linear": (False, "only False (the families have no linear biases)"),
    "gated_linear_unit": (True, "only True (SwiGLU)"),
    "normalization": ("RMSNorm", "only RMSNorm"),
    "attention_dropout": (0.0, "dropout on attention probabilities (training only)"),
    "hidden_dropout": (0.0, "dropout on the attention and MLP outputs before the residual add"),
    "position_embedding_type": ("rope", "'rope' or 'yarn' (yarn builds rope_scaling from the keys below)"),
    "rotary_scaling_factor": (None, "YaRN factor with position_embedding_type: yarn"),
    "scaling_factor": (None, "older name of rotary_scaling_factor"),
    "beta_fast": (None, "YaRN beta_fast"),
    "beta_slow": (None, "YaRN beta_slow"),
    "mscale": (None, "YaRN mscale"),
    "mscale_all_dim": (None, "YaRN mscale_all_dim"),
    "original_max_position_embeddings": (None, "YaRN / Llama-3 pre-training context length"),
    "qk_layernorm": (None, "must match the family (True for qwen3, qwen3_moe, deepseek_v3)"),
    "multi_latent_attention": (None, "must match the family (True only for deepseek_v3)"),
    "use_attn_mask_compression": (False, _no_effect("use_attn_mask_compression")),
    "use_eod_attn_mask_compression": (False, _no_effect("use_eod_attn_mask_compression")),
    "use_pad_tokens": (False, _no_effect("use_pad_tokens")),
    "loss_chunk_size": (
        512,
        "lmforge extension: tokens per chunk of the output projection + cross-entropy, so the full "
        "[tokens, vocab] logits never exist (0 = compute them whole and return them with the loss)",
    ),
}
MOE_MF_KEYS: dict[str, tuple[Any, str]] = {
    "moe_grouped_gemm": (True, _no_effect("moe_grouped_gemm")),
    "moe_token_dispatcher_type": ("alltoall", _no_effect("moe_token_dispatcher_type")),
    "moe_token_drop_policy": ("probs", _no_effect("moe_token_drop_policy")),
    "moe_router_fusion": (True, _no_effect("moe_router_fusion")),
    "moe_permute_fusion": (False, _no_effect("moe_permute_fusion")),
    "router_dense_type": ("float32", "the router runs in fp32; only float32 is accepted"),
    "moe_router_load_balancing_type": (None, "'none', 'aux_loss' or 'seq_aux_loss'"),
    "moe_aux_loss_coeff": (None, "weight of the load-balancing loss"),
    "moe_router_enable_expert_bias": (None, "aux-loss-free balancing with a per-expert routing bias"),
    "moe_router_bias_update_rate": (1e-3, "step of the expert-bias update"),
    "moe_router_score_function": (None, "alias of scoring_func"),
    "moe_router_topk_scaling_factor": (None, "alias of routed_scaling_factor"),
    "moe_router_topk": (None, "alias of num_experts_per_tok"),
    "moe_shared_expert_intermediate_size": (None, "total width of the shared experts"),
}
MLA_MF_KEYS: dict[str, tuple[Any, str]] = {
    "mla_qkv_concat": (True, _no_effect("mla_qkv_concat")),
    "mtp_loss_scaling_factor": (0.1, "weight of the mean MTP loss"),
    "moe_router_num_groups": (None, "alias of n_group"),
    "moe_router_group_topk": (None, "alias of topk_group"),
}
# Bookkeeping keys of a Hugging Face config.json: accepted, no effect on training.
HF_BOOKKEEPING_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "pretraining_tp",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
)
# lmforge's keys naming where a model section came from (lmforge.models.pretrained): the Hugging Face
# directory whose config.json it was taken from, and that file's keys lmforge does not model.
SOURCE_KEYS = ("from_pretrained", "hf_config")
FP32_ONLY_KEYS = ("layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype", "router_dense_type")
# alias -> the Hugging Face key(s) it stands for (the first one the family has is used). The original's
# TransformerConfig names (DeepseekV3ConfigConverter's rename table) and its moe_router_* spellings.
ALIASES: dict[str, tuple[str, ...]] = {
    "moe_router_score_function": ("scoring_func",),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor",),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_router_num_groups": ("n_group",),
    "moe_router_group_topk": ("topk_group",),
    "scaling_factor": ("rotary_scaling_factor",),
    "num_layers": ("num_hidden_layers",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_query_groups": ("num_key_value_heads",),
    "mtp_num_layers": ("num_nextn_predict_layers",),
    "num_moe_experts": ("n_routed_experts", "num_experts"),
    "shared_expert_num": ("n_shared_experts",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "rotary_base": ("rope_theta",),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim",),
    "layernorm_epsilon": ("rms_norm_eps",),
    "init_method_std": ("initializer_range",),
}
ALIAS_DEFAULTS = {
    alias: (None, f"alias of {' / '.join(targets)} (the original's name)")
    for alias, targets in ALIASES.items()
    if alias
    not in (
        "moe_router_score_function",
        "moe_router_topk_scaling_factor",
        "moe_router_topk",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "scaling_factor",
    )
}


def alias_target(alias: str, keys: dict[str, Any] | list[str]) -> str | None:
    return next((t for t in ALIASES.get(alias, ()) if t in keys), None)


@dataclass
class FamilyKeys:
    model_type: str
    architectures: tuple[str, ...]
    hf: dict[str, Any]  # Hugging Face structure keys and their defaults
    moe: bool = False
    mla: bool = False
    extra_mf: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def mf_keys(self) -> dict[str, tuple[Any, str]]:
        keys = dict(COMMON_MF_KEYS)
        keys.update(ALIAS_DEFAULTS)
        if self.moe:
            keys.update(MOE_MF_KEYS)
        if self.mla:
            keys.update(MLA_MF_KEYS)
        keys.update(self.extra_mf)
        names = [*self.hf, *keys]
        return {k: v for k, v in keys.items() if k not in ALIASES or alias_target(k, names) is not None}

    def valid_keys(self) -> list[str]:
        return ["model_type", "architectures", *self.hf, *self.mf_keys(), *HF_BOOKKEEPING_KEYS, *SOURCE_KEYS]


def unknown_key_error(key: str | list[str], valid: list[str], where: str) -> ConfigError:
    """One error naming every unknown key (with the closest valid key of each)."""
    keys = [key] if isinstance(key, str) else list(key)
    valid_text = f"Valid keys: {', '.join(sorted(valid))}."
    hints = {k: difflib.get_close_matches(k, valid, n=1) for k in keys}
    if len(keys) == 1:
        close = hints[keys[0]]
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return ConfigError(f"model.{keys[0]} is not a key of {where}.{hint} {valid_text}")
    named = ", ".join(f"model.{k}" + (f" (Did you mean '{hints[k][0]}'?)" if hints[k] else "") for k in keys)
    return ConfigError(f"{named} are not keys of {where}. {valid_text}")


def require_value(value: Any, key: str, allowed: tuple[Any, ...], why: str) -> None:
    """Refuse ``value`` of ``model.<key>`` unless it is unset (None) or one of ``allowed``."""
    if value is not None and value not in allowed:
        raise ConfigError(f"model.{key} = {value!r} is not supported: {why}. Valid: {list(allowed)}.")


def rope_settings(values: Any, key_prefix: str = "model") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a typed model section (``models/common/section.py``), from its
    rope_theta / rope_scaling / rope_parameters / position_embedding_type and YaRN keys."""
    theta = values.rope_theta
    scaling = values.rope_scaling
    params = values.rope_parameters
    if params:
        if not isinstance(params, dict):
            raise ConfigError(f"{key_prefix}.rope_parameters must be a mapping, got {type(params).__name__}.")
        params = dict(params)
        theta = params.pop("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(
            f"{key_prefix}.rope_scaling must be a mapping or null, got {type(scaling).__name__}."
        )
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    pe_type = values.position_embedding_type or "rope"
    if pe_type not in ("rope", "yarn", "llama3"):
        raise ConfigError(
            f"{key_prefix}.position_embedding_type = {pe_type!r} is not supported; valid: 'rope', 'yarn', 'llama3'."
        )
    if pe_type == "yarn" and not scaling:
        # The original's MLATransformerConfig defaults for the YaRN keys it reads from the model section.
        def pick(given: Any, default: Any) -> Any:
            return given if given is not None else default

        scaling = {
            "rope_type": "yarn",
            "factor": float(pick(values.rotary_scaling_factor, 40)),
            "original_max_position_embeddings": int(pick(values.original_max_position_embeddings, 4096)),
            "beta_fast": float(pick(values.beta_fast, 32)),
            "beta_slow": float(pick(values.beta_slow, 1)),
            "mscale": float(pick(values.mscale, 0.707)),
            "mscale_all_dim": float(pick(values.mscale_all_dim, 0.707)),
        }
    if scaling and "factor" not in scaling:
        raise ConfigError(f"{key_prefix}.rope_scaling needs 'factor' for rope_type {scaling['rope_type']!r}.")
    return float(theta if theta is not None else 10000.0), scaling
