"""Pieces of ``model`` section → ``TransformerConfig`` conversion that every family shares."""

from __future__ import annotations

from typing import Any

from lmforge.errors import ConfigError
from lmforge.models.common.config_keys import require_value, rope_settings
from lmforge.models.common.dtypes import parse_dtype
from lmforge.utils.device import run_device_type
from lmforge.utils.native_dtype import AUTO, choose_compute_dtype


def positive_int(values: dict[str, Any], key: str, allow_zero: bool = False) -> int:
    v = values.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (v == 0 and not allow_zero):
        raise ConfigError(
            f"model.{key} = {v!r} must be a {'non-negative' if allow_zero else 'positive'} integer."
        )
    return v


def compute_dtype_fields(value: Any) -> dict[str, Any]:
    """``compute_dtype`` and ``compute_dtype_auto`` of a ``model.compute_dtype`` value. ``auto`` (an lmforge
    extension) is resolved here for the device this process would train on (CUDA when available, else
    the CPU); the builder resolves it again when ``--device`` names another device type."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        dtype = choose_compute_dtype(AUTO, run_device_type(None)).dtype
        return {"compute_dtype": dtype, "compute_dtype_auto": True}
    try:
        dtype = parse_dtype(value, "model.compute_dtype")
    except ConfigError as err:
        raise ConfigError(
            f"{err} Or 'auto': bf16 where the device computes it natively, float32 elsewhere."
        ) from None
    return {"compute_dtype": dtype, "compute_dtype_auto": False}


def common_fields(values: dict[str, Any], family_qk_norm: bool, family_mla: bool) -> dict[str, Any]:
    """Fields of TransformerConfig that mean the same in every family."""
    require_value(values, "hidden_act", ("silu", "swiglu", "fusedswiglu"), "the MLP is SwiGLU")
    require_value(values, "add_bias_linear", (False,), "these families have no linear biases")
    require_value(values, "gated_linear_unit", (True,), "the MLP is gated (SwiGLU)")
    require_value(values, "normalization", ("RMSNorm",), "the families use RMSNorm")
    require_value(values, "qk_layernorm", (family_qk_norm,), f"this family has qk_layernorm={family_qk_norm}")
    require_value(
        values,
        "multi_latent_attention",
        (family_mla,),
        f"this family has multi_latent_attention={family_mla}",
    )
    for key in ("attention_dropout", "hidden_dropout"):
        v = values.get(key) or 0.0
        if not 0.0 <= float(v) < 1.0:
            raise ConfigError(f"model.{key} = {v!r} must be in [0, 1).")
    theta, scaling = rope_settings(values)
    hidden = positive_int(values, "hidden_size")
    heads = positive_int(values, "num_attention_heads")
    kv_heads = positive_int(values, "num_key_value_heads") if values.get("num_key_value_heads") else heads
    if heads % kv_heads:
        raise ConfigError(
            f"model.num_key_value_heads = {kv_heads} must divide model.num_attention_heads = {heads}."
        )
    head_dim = positive_int(values, "head_dim") if values.get("head_dim") else hidden // heads
    if head_dim < 1:
        raise ConfigError(
            f"model.num_attention_heads = {heads} is larger than model.hidden_size = {hidden}: each head "
            "would have no dimension; give model.head_dim or fewer heads."
        )
    for key, low in (("rms_norm_eps", "> 0"), ("initializer_range", ">= 0")):
        v = values.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if low == "> 0" else v >= 0):
            raise ConfigError(f"model.{key} = {v!r} must be a number {low}.")
    return dict(
        vocab_size=positive_int(values, "vocab_size"),
        hidden_size=hidden,
        num_layers=positive_int(values, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(values["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(values.get("tie_word_embeddings")),
        max_position_embeddings=positive_int(values, "max_position_embeddings"),
        initializer_range=float(values["initializer_range"]),
        attention_dropout=float(values.get("attention_dropout") or 0.0),
        hidden_dropout=float(values.get("hidden_dropout") or 0.0),
        **compute_dtype_fields(values.get("compute_dtype") or "bfloat16"),
        params_dtype=parse_dtype(values.get("params_dtype") or "float32", "model.params_dtype"),
        seq_length=positive_int(values, "seq_length"),
        loss_chunk_size=positive_int(values, "loss_chunk_size", allow_zero=True),
    )


def moe_balance(values: dict[str, Any], default_type: str, default_coeff: float) -> tuple[str, float]:
    kind = values.get("moe_router_load_balancing_type") or default_type
    if kind not in ("none", "aux_loss", "seq_aux_loss"):
        raise ConfigError(
            f"model.moe_router_load_balancing_type = {kind!r} is not supported; valid: 'none', 'aux_loss', "
            "'seq_aux_loss'."
        )
    coeff = values.get("moe_aux_loss_coeff")
    coeff = default_coeff if coeff is None else float(coeff)
    if coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff = {coeff} must be >= 0.")
    return kind, coeff


def check_experts(values: dict[str, Any], experts_key: str, num_experts: int) -> int:
    top_k = values.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ConfigError(
            f"model.num_experts_per_tok = {top_k!r} must be an integer in [1, {experts_key} = {num_experts}]."
        )
    return top_k
