"""Checks of a built ``TransformerConfig`` that every family shares: the dimensions and numeric domains
the model relies on, so that ``lmforge check`` refuses what ``train`` would crash on or train as NaN.

They run on the structure a family produced (``models/registry.resolve``), after its own key checks,
and name the ``model.<key>`` of the YAML (a family that derives a field names the key it came from).
"""

from __future__ import annotations

import math
from typing import Any

from lmforge.errors import ConfigError
from lmforge.models.common.transformer_config import TransformerConfig


def _finite_positive(value: Any, key: str, why: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"model.{key} = {value!r} must be a finite number > 0 ({why}).")


def _finite(value: Any, key: str, low: float, why: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
    ):
        raise ConfigError(f"model.{key} = {value!r} must be a finite number >= {low:g} ({why}).")


def _check_attention(cfg: TransformerConfig, given: bool) -> None:
    if cfg.multi_latent_attention:
        for key in ("qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"model.{key} = {getattr(cfg, key)!r} must be a positive integer (MLA).")
        if cfg.qk_rope_head_dim < 2 or cfg.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.qk_rope_head_dim = {cfg.qk_rope_head_dim} must be a positive even number: rotary "
                "embeddings rotate pairs of dimensions."
            )
        return
    if not given and cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size = {cfg.hidden_size} is not divisible by model.num_attention_heads = "
            f"{cfg.num_attention_heads}, and model.head_dim is not set (it defaults to hidden_size / heads): set "
            "model.head_dim, or a hidden_size that the number of heads divides."
        )
    if cfg.head_dim % 2:
        derived = "" if given else " (model.hidden_size / model.num_attention_heads)"
        raise ConfigError(
            f"model.head_dim = {cfg.head_dim}{derived} must be even: rotary embeddings rotate pairs of "
            "dimensions of each head."
        )


def _check_rope(cfg: TransformerConfig) -> None:
    _finite_positive(
        cfg.rope_theta, "rope_theta", "the base of the rotary frequencies; 0 makes every step NaN"
    )
    scaling = cfg.rope_scaling or {}
    if "factor" in scaling:
        _finite_positive(scaling["factor"], "rope_scaling.factor", "the context extension factor")
    for key in ("original_max_position_embeddings",):
        if key in scaling:
            _finite_positive(scaling[key], f"rope_scaling.{key}", "a length in tokens")


def _check_moe(cfg: TransformerConfig) -> None:
    if cfg.num_experts <= 0:
        return
    if cfg.moe_intermediate_size < 1:
        raise ConfigError(
            f"model.moe_intermediate_size = {cfg.moe_intermediate_size!r} must be a positive integer (the "
            "hidden size of each expert)."
        )
    # n_group / topk_group / num_experts_per_tok: checked by the MoE families' own key checks.
    _finite_positive(
        cfg.routed_scaling_factor, "routed_scaling_factor", "it scales the routed experts' output"
    )


def check_transformer_config(cfg: TransformerConfig, head_dim_given: bool) -> None:
    """Refuse dimensions and numeric values the model cannot train with (ConfigError naming the key).
    ``head_dim_given``: the section set ``head_dim`` (else it was derived as hidden_size / heads)."""
    _check_attention(cfg, head_dim_given)
    _check_rope(cfg)
    _finite_positive(cfg.rms_norm_eps, "rms_norm_eps", "it keeps RMSNorm's division finite")
    _finite(cfg.initializer_range, "initializer_range", 0.0, "the standard deviation of the initial weights")
    _check_moe(cfg)
    if cfg.mtp_num_layers:
        _finite(cfg.mtp_loss_scaling_factor, "mtp_loss_scaling_factor", 0.0, "the weight of the MTP loss")
