"""Refusing a model that cannot fit before anything is allocated.

Absurd dimensions (a typo'd ``hidden_size: 40960000``, a vocabulary of 10^11) otherwise fail deep inside
``torch.empty`` with an overflow or an allocator error, or build millions of layers for minutes. The
parameter count here is an upper-bound formula over the resolved model config (no module is built):
embeddings, attention projections, dense and expert MLPs, norms. A model whose weights alone exceed
the memory of every process of the run together is refused with the numbers.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lmforge.errors import ConfigError


def parameter_upper_bound(cfg: Any) -> int:
    """An upper bound of the parameter count of a resolved ``TransformerConfig`` (pure arithmetic)."""
    h = int(cfg.hidden_size)
    layers = int(cfg.num_layers) + int(getattr(cfg, "mtp_num_layers", 0) or 0)
    heads, kv_heads, head_dim = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.head_dim)
    q_dim = max(heads * head_dim, heads * (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)))
    kv_dim = max(kv_heads * head_dim, heads * (int(cfg.qk_nope_head_dim) + int(cfg.v_head_dim or head_dim)))
    lora = int(cfg.q_lora_rank or 0) + int(cfg.kv_lora_rank or 0)
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h + lora * (h + q_dim + kv_dim) + 4 * h
    dense = 3 * h * int(cfg.intermediate_size)
    experts = int(cfg.num_experts or 0)
    moe = experts * 3 * h * int(cfg.moe_intermediate_size or 0) + 3 * h * int(
        cfg.shared_expert_intermediate_size or 0
    )
    moe += experts * h
    per_layer = attention + max(dense, moe + dense)
    embeddings = int(cfg.vocab_size) * h * (1 if cfg.tie_word_embeddings else 2)
    return layers * per_layer + embeddings + h


def device_memory_bytes(device: str | torch.device | None) -> int:
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device.index or 0).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def check_model_fits(cfg: Any, device: str | torch.device | None = None, processes: int = 1) -> None:
    """Refuse (ConfigError) a model whose weights alone exceed the memory of all ``processes``."""
    params = parameter_upper_bound(cfg)
    itemsize = torch.empty(0, dtype=cfg.compute_dtype).element_size()
    weights = params * itemsize
    available = device_memory_bytes(device) * max(1, processes)
    if weights > available:
        raise ConfigError(
            f"The model section describes about {params:,} parameters (hidden_size {cfg.hidden_size}, "
            f"num_hidden_layers {cfg.num_layers}, vocab_size {cfg.vocab_size}): {weights / 2**30:,.1f} GiB of "
            f"weights alone, more than the {available / 2**30:,.1f} GiB of memory of the {max(1, processes)} "
            "process(es) of this run. Check the model dimensions for a typo; lmforge refuses before allocating."
        )
