"""Validation of a ``model`` section: known keys per family, types, aliases, "did you mean".

A family declares its Hugging Face structure keys with defaults (``FamilyKeys.hf``); every family also
accepts the original's own keys that apply to it (``COMMON_MF_KEYS``, ``MOE_MF_KEYS``, ``MLA_MF_KEYS``)
and the bookkeeping keys a Hugging Face ``config.json`` carries (token ids, ``use_cache`` ...). Any other
key is an error naming ``model.<key>`` and listing the valid keys: the original silently ignores typos.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError
from lmforge.models.common.dtypes import parse_dtype
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.models")

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
    "use_attn_mask_compression": (False, "no effect: the model accepts attention_mask or actual_seq_len"),
    "use_eod_attn_mask_compression": (False, "no effect: the model accepts attention_mask or actual_seq_len"),
    "use_pad_tokens": (False, "no effect: routing is dropless"),
    "loss_chunk_size": (
        512,
        "lmforge extension: tokens per chunk of the output projection + cross-entropy, so the full "
        "[tokens, vocab] logits never exist (0 = compute them whole and return them with the loss)",
    ),
}
MOE_MF_KEYS: dict[str, tuple[Any, str]] = {
    "moe_grouped_gemm": (True, "no effect: experts are always computed batched"),
    "moe_token_dispatcher_type": (
        "alltoall",
        "no effect here: the parallelism section chooses the dispatcher",
    ),
    "moe_token_drop_policy": ("probs", "no effect: routing is dropless"),
    "moe_router_fusion": (True, "no effect"),
    "moe_permute_fusion": (False, "no effect"),
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
    "mla_qkv_concat": (True, "no effect: a weight layout choice; lmforge keeps q and kv projections apart"),
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
# lmforge's keys naming where a model section came from (lmforge.models.pretrained): the Hugging Face
# directory whose config.json it was taken from, and that file's keys lmforge does not model.
SOURCE_KEYS = ("from_pretrained", "hf_config")
INERT_KEYS = {
    "use_attn_mask_compression",
    "use_eod_attn_mask_compression",
    "use_pad_tokens",
    "moe_grouped_gemm",
    "moe_token_dispatcher_type",
    "moe_token_drop_policy",
    "moe_router_fusion",
    "moe_permute_fusion",
    "mla_qkv_concat",
    "ep_size",
}
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


def _check_type(key: str, value: Any, default: Any) -> None:
    if value is None or default is None:
        return
    ok = True
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(
            f"model.{key} = {value!r} has type {type(value).__name__}; expected {type(default).__name__} "
            f"(e.g. {default!r}). Note: YAML reads 1e-6 without a dot as a string; write 1.e-6."
        )


def resolve_section(raw: dict[str, Any], family: FamilyKeys) -> dict[str, Any]:
    """Validated values for every key of the family (defaults filled, aliases folded into canonical keys)."""
    valid = family.valid_keys()
    unknown = [key for key in raw if key not in valid]
    if unknown:
        raise unknown_key_error(unknown, valid, f"model_type '{family.model_type}'")
    values: dict[str, Any] = {k: v for k, v in family.hf.items()}
    values.update({k: d for k, (d, _) in family.mf_keys().items()})
    for key, value in raw.items():
        default = family.hf.get(key, family.mf_keys().get(key, (None, ""))[0])
        if key in family.hf or key in family.mf_keys():
            _check_type(key, value, default)
        values[key] = value
    for alias in ALIASES:
        canonical = alias_target(alias, list(values))
        if alias in raw and canonical is not None:
            if canonical in raw and raw[canonical] != raw[alias]:
                raise ConfigError(
                    f"model.{alias} = {raw[alias]!r} contradicts model.{canonical} = {raw[canonical]!r}; "
                    f"they are the same setting, give one of them (or equal values)."
                )
            _check_type(alias, raw[alias], family.hf.get(canonical))
            values[canonical] = raw[alias]
    for key in FP32_ONLY_KEYS:
        if key in raw and parse_dtype(raw[key], f"model.{key}") != parse_dtype("float32", key):
            raise ConfigError(
                f"model.{key} = {raw[key]!r} is not supported: lmforge always computes this in float32 "
                "(the original's default). Use 'float32' or remove the key."
            )
    if "params_dtype" in raw and parse_dtype(raw["params_dtype"], "model.params_dtype") != parse_dtype(
        "float32", "params_dtype"
    ):
        _log.warning(
            "model.params_dtype = %r has no effect: lmforge keeps float32 master weights for every "
            "low-precision parameter (parameters themselves are stored in compute_dtype).",
            raw["params_dtype"],
        )
    if raw.get("use_flash_attention") is False:
        _log.warning(
            "model.use_flash_attention: false has no effect: attention always runs through "
            "scaled_dot_product_attention, which picks its own kernel."
        )
    inert = sorted(k for k in raw if k in INERT_KEYS)
    if inert:
        _log.warning(
            "model: %s accepted but have no effect in lmforge (see docs/models.md)", ", ".join(inert)
        )
    bookkeeping = [k for k in raw if k in HF_BOOKKEEPING_KEYS]
    if bookkeeping:
        _log.warning(
            "model: %s accepted but have no effect in lmforge: Hugging Face config.json bookkeeping (the "
            "data's eod/pad come from train_dataset, the dtype from model.compute_dtype).",
            ", ".join(f"model.{k}" for k in bookkeeping),
        )
    return values


def require_value(values: dict[str, Any], key: str, allowed: tuple[Any, ...], why: str) -> None:
    if values.get(key) is not None and values[key] not in allowed:
        raise ConfigError(f"model.{key} = {values[key]!r} is not supported: {why}. Valid: {list(allowed)}.")


def rope_settings(values: dict[str, Any], key_prefix: str = "model") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from rope_theta / rope_scaling / rope_parameters / position_embedding_type."""
    theta = values.get("rope_theta")
    scaling = values.get("rope_scaling")
    params = values.get("rope_parameters")
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
    pe_type = values.get("position_embedding_type") or "rope"
    if pe_type not in ("rope", "yarn", "llama3"):
        raise ConfigError(
            f"{key_prefix}.position_embedding_type = {pe_type!r} is not supported; valid: 'rope', 'yarn', 'llama3'."
        )
    if pe_type == "yarn" and not scaling:
        # The original's MLATransformerConfig defaults for the YaRN keys it reads from the model section.
        def pick(key: str, default: Any) -> Any:
            return values.get(key) if values.get(key) is not None else default

        scaling = {
            "rope_type": "yarn",
            "factor": float(pick("rotary_scaling_factor", 40)),
            "original_max_position_embeddings": int(pick("original_max_position_embeddings", 4096)),
            "beta_fast": float(pick("beta_fast", 32)),
            "beta_slow": float(pick("beta_slow", 1)),
            "mscale": float(pick("mscale", 0.707)),
            "mscale_all_dim": float(pick("mscale_all_dim", 0.707)),
        }
    if scaling and "factor" not in scaling:
        raise ConfigError(f"{key_prefix}.rope_scaling needs 'factor' for rope_type {scaling['rope_type']!r}.")
    return float(theta if theta is not None else 10000.0), scaling
