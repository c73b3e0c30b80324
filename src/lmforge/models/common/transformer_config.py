"""The family-independent description of a decoder-only transformer that ``GPTModel`` builds.

Each family's ``config.py`` turns the YAML ``model`` section (Hugging Face key names plus the original's
own keys) into one of these; nothing below knows about YAML or Hugging Face names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TransformerConfig:
    model_type: str
    architectures: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # Multi-latent attention (DeepSeek-V3)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts; ``moe_layers`` lists the decoder layer ids whose MLP is an MoE layer
    num_experts: int = 0
    moe_layers: tuple[int, ...] = ()
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    norm_topk_prob: bool = False
    score_function: str = "softmax"
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balancing_type: str = "none"
    aux_loss_coeff: float = 0.0
    # Multi-token prediction (DeepSeek-V3)
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # Numerics
    compute_dtype: torch.dtype = torch.bfloat16
    # True when the section said ``compute_dtype: auto``: compute_dtype is then the device's native
    # choice (lmforge.utils.native_dtype), re-resolved by the builder for the device the run uses.
    compute_dtype_auto: bool = False
    params_dtype: torch.dtype = torch.float32
    seq_length: int = 4096
    # lmforge extension: tokens per chunk of the output projection + cross-entropy (0 = full logits).
    # Chunked by default: on CPU the step of the demo model takes ~0.6x the time of the plain loss's
    # (the [chunk, vocab] logits stay in cache; no zero-filled NLL gradient, no separate softmax backward).
    loss_chunk_size: int = 512
    # Settings only one family's own blocks read (a new family puts its options here, not new fields)
    family_options: dict[str, Any] = field(default_factory=dict)
    # Keys that only matter for writing a Hugging Face config.json back (token ids, rope_interleave, ...)
    hf_extra: dict[str, Any] = field(default_factory=dict)
    # The validated model section as given (written next to converted checkpoints)
    section: dict[str, Any] = field(default_factory=dict)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and layer_id in self.moe_layers
