"""Tensor-parallel plans as data: what each submodule of a decoder layer does under TP + SP.

A family declares ``tp_plan(cfg, layer_id) -> TPPlan``: module paths relative to the decoder layer
(``"self_attention.linear_qkv"``) mapped to styles. ``lmforge.parallel.tp`` applies them; models never
import anything distributed. Modules a plan does not name stay replicated over tp and run on this
rank's sequence shard (right for token-wise blocks such as routed experts; attention must be named).
Styles are applied in the plan's order.

The fused weights are stored so that a plain row split gives whole units (``models/common/fused_layout.py``):
one piece each.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.common.transformer_config import TransformerConfig


@dataclass(frozen=True)
class GatherSequence:
    """The block's first input arrives as a sequence shard and is gathered to the full sequence."""


@dataclass(frozen=True)
class FusedColwise:
    """A Linear whose output rows are ``pieces`` (sizes); every piece is split over the tp ranks."""

    pieces: tuple[int, ...]


@dataclass(frozen=True)
class RowwiseToSequence:
    """A Linear whose input is this rank's slice of the features; output reduce-scattered to sequence shards."""


@dataclass(frozen=True)
class PerRankCounts:
    """Integer attributes (head counts, row sizes) divided by the tp degree; optimizer and monitor hooks
    (``muon_split_schema``, ``qk_clip_layer``, ``flops_per_token``) still see the global values."""

    attributes: tuple[str, ...]


@dataclass(frozen=True)
class LocalHeads:
    """A ``CoreAttention`` computing this rank's heads (tracks max logits at their global head index)."""


@dataclass(frozen=True)
class SequenceAuxLoss:
    """A router whose balancing loss must see the whole sequence, not this rank's shard."""


Style = GatherSequence | FusedColwise | RowwiseToSequence | PerRankCounts | LocalHeads | SequenceAuxLoss
TPPlan = dict[str, tuple[Style, ...]]


def gqa_attention_plan(cfg: TransformerConfig, prefix: str = "self_attention") -> TPPlan:
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        prefix: (GatherSequence(), PerRankCounts(("num_heads", "num_kv_heads", "q_rows", "kv_rows"))),
        f"{prefix}.linear_qkv": (FusedColwise((q_rows + 2 * kv_rows,)),),  # whole kv groups per rank
        f"{prefix}.core_attention": (PerRankCounts(("num_heads",)), LocalHeads()),
        f"{prefix}.linear_proj": (RowwiseToSequence(),),
    }


def mla_attention_plan(cfg: TransformerConfig, prefix: str = "self_attention") -> TPPlan:
    n = cfg.num_attention_heads
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_name = "linear_q_up_proj" if cfg.q_lora_rank else "linear_q_proj"
    return {
        prefix: (GatherSequence(), PerRankCounts(("num_heads",))),
        f"{prefix}.{q_name}": (FusedColwise((n * (dn + dr),)),),  # whole heads per rank
        f"{prefix}.linear_kv_up_proj": (FusedColwise((n * (dn + dv),)),),
        f"{prefix}.core_attention": (PerRankCounts(("num_heads",)), LocalHeads()),
        f"{prefix}.linear_proj": (RowwiseToSequence(),),
    }


def swiglu_plan(ffn_hidden_size: int, prefix: str = "mlp") -> TPPlan:
    f = ffn_hidden_size
    return {
        prefix: (GatherSequence(),),
        f"{prefix}.linear_fc1": (FusedColwise((2 * f,)),),  # whole gate/up pairs per rank
        f"{prefix}.linear_fc2": (RowwiseToSequence(),),
    }


def moe_plan(cfg: TransformerConfig, layer_id: int, prefix: str = "mlp") -> TPPlan:
    """The plan of ``blocks.moe_mlp``: routed experts replicated on sequence shards; shared experts split."""
    if not cfg.is_moe_layer(layer_id):
        return swiglu_plan(cfg.intermediate_size, prefix)
    plan: TPPlan = {f"{prefix}.router": (SequenceAuxLoss(),)}
    if cfg.shared_expert_intermediate_size:
        plan.update(swiglu_plan(cfg.shared_expert_intermediate_size, f"{prefix}.shared_experts"))
    return plan
