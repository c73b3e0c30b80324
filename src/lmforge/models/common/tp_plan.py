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
class ReplicateInput:
    """DTensor path: the block's first input arrives as a sequence shard and becomes a replicated DTensor
    (one all-gather, whose backward reduce-scatters) for the ``ColwiseShard`` projections that read it."""


@dataclass(frozen=True)
class ColwiseShard:
    """DTensor path: torch's ``ColwiseParallel`` on a Linear whose output rows are ``units`` equal whole
    units (``what``); reads a replicated DTensor input, returns this rank's output columns."""

    units: int
    what: str


@dataclass(frozen=True)
class RowwiseShard:
    """DTensor path: torch's ``RowwiseParallel`` on a Linear whose input is this rank's slice of the
    features; the output is reduce-scattered to this rank's sequence shard."""


@dataclass(frozen=True)
class ReplicatedOnShard:
    """DTensor path: a module with replicated weights applied element- or row-wise to this rank's shard of
    its input along ``dim`` (torch's ``SequenceParallel``; e.g. per-head norms on this rank's heads)."""

    dim: int


@dataclass(frozen=True)
class Replicated:
    """DTensor path: a module whose parameters (LoRA adapters included) are replicated DTensors, computing
    on the block's replicated DTensor input (MLA's down projections and latent norms)."""


@dataclass(frozen=True)
class SharedToLocal:
    """DTensor path: a module whose replicated DTensor output is read by this rank's heads only; it becomes
    a plain local tensor whose gradient is a partial sum over the ranks (MLA's ``shared_k_rope``)."""


@dataclass(frozen=True)
class LocalHeads:
    """A ``CoreAttention`` computing this rank's heads (tracks max logits at their global head index)."""


@dataclass(frozen=True)
class SequenceAuxLoss:
    """A router's ``balance_inputs`` (``models/common/moe.py``): its balancing loss must see the whole
    sequence, not this rank's shard, so its scores and choices are gathered over the sequence."""


Style = (
    ReplicateInput
    | ColwiseShard
    | RowwiseShard
    | ReplicatedOnShard
    | Replicated
    | SharedToLocal
    | LocalHeads
    | SequenceAuxLoss
)
TPPlan = dict[str, tuple[Style, ...]]


def gqa_attention_plan(cfg: TransformerConfig, prefix: str = "self_attention") -> TPPlan:
    groups = ColwiseShard(cfg.num_key_value_heads, "key-value groups (num_key_value_heads)")
    plan: TPPlan = {
        prefix: (ReplicateInput(),),
        f"{prefix}.linear_qkv": (groups,),
        f"{prefix}.core_attention": (LocalHeads(),),
        f"{prefix}.linear_proj": (RowwiseShard(),),
    }
    if cfg.qk_norm:  # per-head norms ([b, s, heads, d]) on this rank's heads
        plan[f"{prefix}.q_layernorm"] = plan[f"{prefix}.k_layernorm"] = (ReplicatedOnShard(2),)
    return plan


def mla_attention_plan(cfg: TransformerConfig, prefix: str = "self_attention") -> TPPlan:
    """Up projections split per head; down projections and latent norms replicated, computing on the
    gathered block input; the shared rope key leaves DTensor for this rank's heads."""
    heads = ColwiseShard(cfg.num_attention_heads, "attention heads (num_attention_heads)")
    plan: TPPlan = {prefix: (ReplicateInput(),)}
    if cfg.q_lora_rank:
        plan[f"{prefix}.linear_q_down_proj"] = (Replicated(),)
        plan[f"{prefix}.q_layernorm"] = (Replicated(),)
        plan[f"{prefix}.linear_q_up_proj"] = (heads,)
    else:
        plan[f"{prefix}.linear_q_proj"] = (heads,)
    plan.update(
        {
            f"{prefix}.linear_kv_down_proj": (Replicated(),),
            f"{prefix}.shared_k_rope": (SharedToLocal(),),
            f"{prefix}.kv_layernorm": (Replicated(),),
            f"{prefix}.linear_kv_up_proj": (heads,),
            f"{prefix}.core_attention": (LocalHeads(),),
            f"{prefix}.linear_proj": (RowwiseShard(),),
        }
    )
    return plan


def swiglu_plan(ffn_hidden_size: int, prefix: str = "mlp") -> TPPlan:
    return {
        prefix: (ReplicateInput(),),
        f"{prefix}.linear_fc1": (ColwiseShard(ffn_hidden_size, f"gate/up pairs ({prefix} FFN width)"),),
        f"{prefix}.linear_fc2": (RowwiseShard(),),
    }


def moe_plan(cfg: TransformerConfig, layer_id: int, prefix: str = "mlp") -> TPPlan:
    """The plan of ``blocks.moe_mlp``: routed experts replicated on sequence shards; shared experts split."""
    if not cfg.is_moe_layer(layer_id):
        return swiglu_plan(cfg.intermediate_size, prefix)
    plan: TPPlan = {f"{prefix}.router.balance_inputs": (SequenceAuxLoss(),)}
    if cfg.shared_expert_intermediate_size:
        plan.update(swiglu_plan(cfg.shared_expert_intermediate_size, f"{prefix}.shared_experts"))
    return plan
