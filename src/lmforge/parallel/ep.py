"""Expert parallel: routed experts split over the ``ep`` ranks, tokens moved by all-to-all.

Rank j of an ep group owns experts ``[j·E/ep, (j+1)·E/ep)``; its expert weights are the ``Shard(0)``
part of ``experts.linear_fc{1,2}.weight`` (so checkpoints keep the full ``[E, ...]`` tensors and load
into any layout). The MoE layer's dispatcher (its only seam) is replaced by
:class:`AllToAllDispatcher`: token copies sorted by expert are sent to the owning rank (one uneven
all-to-all, preceded by an all-to-all of the per-expert counts), computed there, and sent back to be
weighted and summed. Routing, balancing losses and token counting stay in the model, unchanged.

``moe_token_dispatcher_type: alltoall_deredundancy`` (the original's Ascend optimisation that sends a
token once per node rather than once per expert) gives the same numbers as ``alltoall``; it runs as
``alltoall`` with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from lmforge.config.sections_parallel import ParallelismConfig
from lmforge.errors import ConfigError
from lmforge.models.common.moe import moe_layers

logger = logging.getLogger(__name__)


@dataclass
class EPDispatchState:
    token_index: torch.Tensor
    weights: torch.Tensor
    num_tokens: int
    send_splits: list[int]
    recv_splits: list[int]
    local_order: torch.Tensor  # received rows -> rows sorted by local expert


class AllToAllDispatcher:
    """The MoE dispatcher interface (``dispatch`` / ``combine``) over an expert-parallel group."""

    def __init__(self, group: Any, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local = num_experts // self.ep

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
        ep, el = self.ep, self.num_local
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_index = order // topk_idx.shape[1]
        counts = torch.bincount(flat, minlength=num_experts)  # [E], sorted rows are grouped by expert
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ep·El]: source j, local expert e
        recv_counts = recv_counts.view(ep, el)
        send_splits = counts.view(ep, el).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(x[token_index], recv_splits, send_splits, self.group)
        # Received rows are ordered (source rank, local expert); the experts want (local expert, source).
        expert_of_row = torch.repeat_interleave(
            torch.arange(el, device=x.device).repeat(ep), recv_counts.reshape(-1)
        )
        local_order = torch.argsort(expert_of_row, stable=True)
        state = EPDispatchState(
            token_index, topk_weights.reshape(-1)[order], x.shape[0], send_splits, recv_splits, local_order
        )
        return rows[local_order], recv_counts.sum(0), state

    def combine(self, y: torch.Tensor, state: EPDispatchState) -> torch.Tensor:
        back = torch.empty_like(y).index_copy(0, state.local_order, y)
        returned = funcol.all_to_all_single_autograd(back, state.send_splits, state.recv_splits, self.group)
        weighted = returned.float() * state.weights[:, None]
        out = weighted.new_zeros(state.num_tokens, y.shape[-1])
        out.index_add_(0, state.token_index, weighted)
        return out.to(y.dtype)


def apply_ep(model: nn.Module, ep_mesh: Any, section: ParallelismConfig, tp_mesh: Any = None) -> None:
    """Shard routed experts over ``ep_mesh`` and swap in the all-to-all dispatcher (in place)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    kind = section.moe_token_dispatcher_type
    if kind == "alltoall_deredundancy":
        logger.warning(
            "parallelism.moe_token_dispatcher_type: alltoall_deredundancy runs as alltoall (same results; the "
            "per-node de-duplication of token copies is an Ascend communication optimisation not implemented)."
        )
    group = ep_mesh.get_group()
    ep = ep_mesh.size()
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(
            f"parallelism.expert_parallel={ep} needs a mixture-of-experts model; this model has no MoE layer."
        )
    tp_group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
    # With tp > 1 the expert shard is replicated over tp and each tp rank routes its own tokens.
    mesh = ep_mesh if tp_group is None else ep_mesh._get_root_mesh()["ep", "tp"]
    placements = [Shard(0)] if tp_group is None else [Shard(0), Replicate()]
    for moe in layers:
        experts = moe.experts
        num = experts.num_experts
        if num % ep:
            raise ConfigError(
                f"parallelism.expert_parallel={ep} must divide the number of routed experts ({num})."
            )
        holders = [experts.linear_fc1, experts.linear_fc2]
        for holder in holders:
            w = holder.weight
            holder.register_parameter(
                "weight",
                nn.Parameter(distribute_tensor(w.data, mesh, placements), requires_grad=w.requires_grad),
            )
        # GroupedExperts reads its local experts itself (models/common/local_weight.py).
        moe.dispatcher = AllToAllDispatcher(group, num)
