"""Block factories: how a family builds the attention and MLP of decoder layer ``layer_id``.

A family's model class names its :class:`LayerBlocks`; ``TransformerLayer`` calls the two factories and
knows nothing of GQA, MLA, dense or MoE. A block is an ``nn.Module`` whose ``forward`` takes the
normalised hidden states (attention also ``cos, sin, allowed``) and returns a tensor of the same shape,
with ``flops_per_token(hidden_size)`` (attention: ``(hidden_size, seq_length)``) for MFU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lmforge.models.common.attention import SelfAttention
from lmforge.models.common.mla import MultiLatentAttention
from lmforge.models.common.mlp import SwiGLUMLP
from lmforge.models.common.moe import MoELayer, RouterSettings
from lmforge.models.common.rope import yarn_softmax_scale_factor
from lmforge.models.common.transformer_config import TransformerConfig

BlockFactory = Callable[[TransformerConfig, int], nn.Module]


@dataclass(frozen=True)
class LayerBlocks:
    attention: BlockFactory
    mlp: BlockFactory


def gqa_attention(cfg: TransformerConfig, layer_id: int) -> SelfAttention:
    return SelfAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qk_norm=cfg.qk_norm,
        norm_eps=cfg.rms_norm_eps,
        bias=cfg.attention_bias,
        dropout=cfg.attention_dropout,
    )


def mla_attention(cfg: TransformerConfig, layer_id: int) -> MultiLatentAttention:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale_factor(
        cfg.rope_scaling
    )
    return MultiLatentAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        scale,
        cfg.attention_dropout,
    )


def swiglu_mlp(cfg: TransformerConfig, layer_id: int) -> SwiGLUMLP:
    return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)


def moe_mlp(cfg: TransformerConfig, layer_id: int) -> nn.Module:
    """An MoE layer on the layers ``cfg.moe_layers`` lists, the dense SwiGLU MLP on the others."""
    if not cfg.is_moe_layer(layer_id):
        return swiglu_mlp(cfg, layer_id)
    settings = RouterSettings(
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        score_function=cfg.score_function,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        group_score=cfg.group_score,
        norm_topk_prob=cfg.norm_topk_prob,
        scaling_factor=cfg.routed_scaling_factor,
        enable_expert_bias=cfg.enable_expert_bias,
        bias_update_rate=cfg.bias_update_rate,
        load_balancing_type=cfg.load_balancing_type,
        aux_loss_coeff=cfg.aux_loss_coeff,
    )
    return MoELayer(cfg.hidden_size, cfg.moe_intermediate_size, settings, cfg.shared_expert_intermediate_size)
