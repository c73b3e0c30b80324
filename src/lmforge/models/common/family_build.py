"""Pieces of typed ``model`` section → ``TransformerConfig`` conversion that every family shares.

``values`` is the family's validated section (``models/common/section.py``): every key the family
accepts is an attribute, its default filled in and aliases folded into the canonical key.
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import ConfigError
from lmforge.models.common.config_keys import require_value, rope_settings
from lmforge.models.common.dtypes import parse_dtype
from lmforge.utils.device import run_device_type
from lmforge.utils.native_dtype import AUTO, choose_compute_dtype


def positive_int(v: Any, key: str, allow_zero: bool = False) -> int:
    """``v``, the value of ``model.<key>``, if it is a positive (or, with ``allow_zero``, non-negative) int."""
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


def common_fields(values: Any, family_qk_norm: bool, family_mla: bool) -> dict[str, Any]:
    """Fields of TransformerConfig that mean the same in every family."""
    require_value(values.hidden_act, "hidden_act", ("silu", "swiglu", "fusedswiglu"), "the MLP is SwiGLU")
    require_value(values.add_bias_linear, "add_bias_linear", (False,), "these families have no linear biases")
    require_value(values.gated_linear_unit, "gated_linear_unit", (True,), "the MLP is gated (SwiGLU)")
    require_value(values.normalization, "normalization", ("RMSNorm",), "the families use RMSNorm")
    require_value(
        values.qk_layernorm,
        "qk_layernorm",
        (family_qk_norm,),
        f"this family has qk_layernorm={family_qk_norm}",
    )
    require_value(
        values.multi_latent_attention,
        "multi_latent_attention",
        (family_mla,),
        f"this family has multi_latent_attention={family_mla}",
    )
    dropout = {"attention_dropout": values.attention_dropout, "hidden_dropout": values.hidden_dropout}
    for key, v in dropout.items():
        if not 0.0 <= float(v or 0.0) < 1.0:
            raise ConfigError(f"model.{key} = {v!r} must be in [0, 1).")
    theta, scaling = rope_settings(values)
    hidden = positive_int(values.hidden_size, "hidden_size")
    heads = positive_int(values.num_attention_heads, "num_attention_heads")
    kv_given = values.num_key_value_heads
    kv_heads = positive_int(kv_given, "num_key_value_heads") if kv_given is not None else heads
    if heads % kv_heads:
        raise ConfigError(
            f"model.num_key_value_heads = {kv_heads} must divide model.num_attention_heads = {heads}."
        )
    # MLA families have no head_dim key (their head sizes are qk_nope/qk_rope/v_head_dim). Only an absent
    # (null) key is derived: a 0 the user wrote is refused, not replaced.
    head_given = getattr(values, "head_dim", None)
    head_dim = positive_int(head_given, "head_dim") if head_given is not None else hidden // heads
    if head_dim < 1:
        raise ConfigError(
            f"model.num_attention_heads = {heads} is larger than model.hidden_size = {hidden}: each head "
            "would have no dimension; give model.head_dim or fewer heads."
        )
    for key, v, low in (
        ("rms_norm_eps", values.rms_norm_eps, "> 0"),
        ("initializer_range", values.initializer_range, ">= 0"),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if low == "> 0" else v >= 0):
            raise ConfigError(f"model.{key} = {v!r} must be a number {low}.")
    return dict(
        vocab_size=positive_int(values.vocab_size, "vocab_size"),
        hidden_size=hidden,
        num_layers=positive_int(values.num_hidden_layers, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(values.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(values.tie_word_embeddings),
        max_position_embeddings=positive_int(values.max_position_embeddings, "max_position_embeddings"),
        initializer_range=float(values.initializer_range),
        attention_dropout=float(values.attention_dropout or 0.0),
        hidden_dropout=float(values.hidden_dropout or 0.0),
        **compute_dtype_fields(values.compute_dtype or "bfloat16"),
        params_dtype=parse_dtype(values.params_dtype or "float32", "model.params_dtype"),
        seq_length=positive_int(values.seq_length, "seq_length"),
        loss_chunk_size=positive_int(values.loss_chunk_size, "loss_chunk_size", allow_zero=True),
    )


def moe_balance(values: Any, default_type: str, default_coeff: float) -> tuple[str, float]:
    kind = values.moe_router_load_balancing_type or default_type
    if kind not in ("none", "aux_loss", "seq_aux_loss"):
        raise ConfigError(
            f"model.moe_router_load_balancing_type = {kind!r} is not supported; valid: 'none', 'aux_loss', "
            "'seq_aux_loss'."
        )
    coeff = values.moe_aux_loss_coeff
    coeff = default_coeff if coeff is None else float(coeff)
    if coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff = {coeff} must be >= 0.")
    return kind, coeff


def check_experts(values: Any, experts_key: str, num_experts: int) -> int:
    top_k = values.num_experts_per_tok
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ConfigError(
            f"model.num_experts_per_tok = {top_k!r} must be an integer in [1, {experts_key} = {num_experts}]."
        )
    return top_k
