"""Mixture of experts: top-k router, token dispatcher, batched experts, shared experts.

Names: ``mlp.router.weight`` ``[E, H]`` (kept in fp32, the original's ``router_dense_type``),
``mlp.router.expert_bias`` ``[E]`` (a persistent fp32 buffer, aux-loss-free balancing),
``mlp.experts.linear_fc1.weight`` ``[E, 2F, H]`` (per expert, gate/up row pairs as in ``mlp.py``),
``mlp.experts.linear_fc2.weight`` ``[E, H, F]``, ``mlp.shared_experts.linear_fc1/fc2``.

Experts are computed batched: tokens are sorted by expert and one padded ``bmm`` per projection runs
all experts at once; no Python loop over experts. Routing is
dropless. The dispatcher is an object the layer receives, so expert parallelism can replace the local
one with an all-to-all one without the model knowing about process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmforge.models.common.fused_layout import gate_up_rows
from lmforge.models.common.local_weight import local_weight
from lmforge.models.common.mlp import SwiGLUMLP, swiglu
from lmforge.utils.muon_split import MuonSplit


@dataclass(frozen=True)
class RouterSettings:
    num_experts: int
    top_k: int
    score_function: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"  # "top2_sum" (DeepSeek-V3 noaux_tc) or "max" (group_limited_greedy)
    norm_topk_prob: bool = False
    scaling_factor: float = 1.0
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balancing_type: str = "none"  # "none", "aux_loss" (per micro-batch) or "seq_aux_loss" (per sequence)
    aux_loss_coeff: float = 0.0


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation recompute): do not count tokens twice."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class BalanceInputs(nn.Module):
    """What the balancing loss sees: the micro-batch's scores ``[b, s, E]`` and choices ``[b, s, K]``.

    The identity in the model; a seam for parallel plans: under tensor parallel each rank routes a shard of
    the sequence, and the plan gathers both over the sequence here (``parallel/tp.py``).
    """

    def forward(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return scores, topk_idx


class TopKRouter(nn.Module):
    keep_fp32 = True  # excluded from the cast to compute_dtype

    def __init__(self, hidden_size: int, settings: RouterSettings) -> None:
        super().__init__()
        self.settings = settings
        self.weight = nn.Parameter(torch.empty(settings.num_experts, hidden_size))
        # Only with aux-loss-free balancing, so checkpoints of models without it carry no such tensor.
        bias = torch.zeros(settings.num_experts) if settings.enable_expert_bias else None
        self.register_buffer("expert_bias", bias)
        self.balance_inputs = BalanceInputs()

    def reset_parameters(self, std: float) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, std)
            if self.expert_bias is not None:
                self.expert_bias.zero_()

    def forward(
        self, x: torch.Tensor, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x ``[T, H]`` → (expert ids ``[T, K]``, fp32 weights ``[T, K]``, weighted aux loss or None)."""
        st = self.settings
        # Under tensor parallel the weight is a replicated DTensor applied to this rank's tokens.
        logits = F.linear(x.float(), local_weight(self.weight).float())
        scores = logits.sigmoid() if st.score_function == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias if st.enable_expert_bias else scores
        if st.n_group > 1:
            # Group-limited routing: keep the topk_group groups with the best group score (the sum of the
            # top two, DeepSeek-V3's noaux_tc, or the maximum, DeepSeek-V2's group_limited_greedy).
            grouped = choice.view(-1, st.n_group, st.num_experts // st.n_group)
            if st.group_score == "top2_sum":
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(st.topk_group, dim=-1).indices, True)
            keep = keep[:, :, None].expand_as(grouped).reshape_as(choice)
            choice = choice.masked_fill(~keep, float("-inf"))
        topk_idx = choice.topk(st.top_k, dim=-1).indices
        weights = scores.gather(1, topk_idx)
        if st.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * st.scaling_factor
        aux = None
        if st.load_balancing_type != "none" and st.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux = self._aux_loss(scores, topk_idx, batch_size)
        return topk_idx, weights, aux

    def _aux_loss(self, scores: torch.Tensor, topk_idx: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Switch-style balance loss E/K · Σ_i f_i·P_i (1.0 when perfectly balanced), times the coefficient.

        f_i is the fraction of routed slots that chose expert i, P_i the mean normalised score of i;
        ``seq_aux_loss`` computes both per sequence and averages the sequences (DeepSeek-V3).
        """
        st = self.settings
        e, k = scores.shape[-1], topk_idx.shape[-1]
        scores, topk_idx = self.balance_inputs(
            scores.reshape(batch_size, -1, e), topk_idx.reshape(batch_size, -1, k)
        )
        scores, topk_idx = scores.reshape(-1, e), topk_idx.reshape(-1, k)
        probs = scores / scores.sum(dim=-1, keepdim=True) if st.score_function == "sigmoid" else scores
        groups = batch_size if st.load_balancing_type == "seq_aux_loss" else 1
        t = probs.shape[0] // groups
        one_hot = torch.zeros_like(probs).scatter_(1, topk_idx, 1.0)
        f = one_hot.view(groups, t, -1).mean(dim=1) / st.top_k  # fraction of routed slots per expert
        p = probs.view(groups, t, -1).mean(dim=1)
        return st.aux_loss_coeff * st.num_experts * (f * p).sum(dim=-1).mean()


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ``[T, K]`` sorted by expert, ``counts`` ``[E]`` rows each: ``x_e @ weight[e].T``.

    ``weight`` is ``[E, N, K]``. One padded ``bmm`` over ``[E, max_count, K]`` computes every expert at
    once. (``torch._grouped_mm`` avoids the padding on recent GPUs; on this CPU build its backward
    rejects unaligned shapes, and no GPU was available to validate it, so it is not used yet.)
    """
    num_experts = weight.shape[0]
    capacity = int(counts.max().item()) if counts.numel() else 0
    if capacity == 0:
        return x.new_zeros(x.shape[0], weight.shape[1])
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts)
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert_of_row]
    padded = x.new_zeros(num_experts, capacity, x.shape[1])
    padded[expert_of_row, slot] = x
    out = torch.bmm(padded, weight.transpose(1, 2))
    return out[expert_of_row, slot]


class ExpertWeight(nn.Module):
    """A holder so the 3-D weight is named ``experts.linear_fc1.weight`` like its Megatron counterpart."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.num_experts, self.ffn_hidden_size = num_experts, ffn_hidden_size
        self.linear_fc1 = ExpertWeight(num_experts, 2 * ffn_hidden_size, hidden_size)
        self.linear_fc2 = ExpertWeight(num_experts, hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by (local) expert; counts: tokens per expert.

        Under expert / tensor parallel the weights are DTensors: this rank's experts, read locally."""
        fc1, fc2 = local_weight(self.linear_fc1.weight), local_weight(self.linear_fc2.weight)
        return grouped_matmul(swiglu(grouped_matmul(x, fc1, counts)), fc2, counts)


@dataclass
class DispatchState:
    token_index: torch.Tensor  # [T*K] source token of every sorted row
    weights: torch.Tensor  # [T*K] fp32 routing weight of every sorted row
    num_tokens: int


class LocalDispatcher:
    """Sorts token copies by expert on this rank and scatters the results back (no communication).

    The interface an expert-parallel dispatcher implements: ``dispatch`` returns the rows for this rank's
    experts (sorted by local expert) and their counts; ``combine`` returns ``[T, H]`` summed outputs.
    """

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_index = order // topk_idx.shape[1]
        counts = torch.bincount(flat, minlength=num_experts)
        state = DispatchState(token_index, topk_weights.reshape(-1)[order], x.shape[0])
        return x[token_index], counts, state

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        weighted = y.float() * state.weights[:, None]
        out = weighted.new_zeros(state.num_tokens, y.shape[-1])
        out.index_add_(0, state.token_index, weighted)
        return out.to(y.dtype)


class MoELayer(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        settings: RouterSettings,
        shared_ffn_hidden_size: int = 0,
        dispatcher: LocalDispatcher | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.router = TopKRouter(hidden_size, settings)
        self.experts = GroupedExperts(settings.num_experts, hidden_size, ffn_hidden_size)
        self.shared_experts = (
            SwiGLUMLP(hidden_size, shared_ffn_hidden_size) if shared_ffn_hidden_size else None
        )
        self.dispatcher = dispatcher or LocalDispatcher()
        # Tokens routed to each expert: one counter for the monitor, one for the expert-bias update.
        self.register_buffer("tokens_per_expert", torch.zeros(settings.num_experts), persistent=False)
        self.register_buffer("bias_update_counts", torch.zeros(settings.num_experts), persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        # Set by parallelize: the ranks that route different tokens; the bias update sums their counts.
        self.bias_counts_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        topk_idx, topk_weights, aux = self.router(tokens, b)
        self.last_aux_loss = aux
        if not in_backward():
            with torch.no_grad():
                counts = torch.bincount(topk_idx.reshape(-1), minlength=self.settings.num_experts).float()
                self.tokens_per_expert += counts
                # Only training tokens steer the aux-loss-free bias (not evaluation or generation).
                if self.training:
                    self.bias_update_counts += counts
        rows, counts, state = self.dispatcher.dispatch(
            tokens, topk_idx, topk_weights, self.settings.num_experts
        )
        out = self.dispatcher.combine(self.experts(rows, counts), state).view(b, s, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing: bias_i += rate·sign(mean load − load_i); resets the step's counts."""
        if self.settings.enable_expert_bias:
            if counts is None and self.bias_counts_group is not None:
                counts = self.bias_update_counts.clone()
                dist.all_reduce(counts, group=self.bias_counts_group)
            load = self.bias_update_counts if counts is None else counts.to(self.bias_update_counts)
            delta = torch.sign(load.mean() - load) * self.settings.bias_update_rate
            self.router.expert_bias += delta.to(self.router.expert_bias)
        self.bias_update_counts.zero_()

    def layout_v1_rows(self) -> dict[str, tuple[int, torch.Tensor]]:
        """Fused child → (dim, rows) with ``stored = layout1[rows]`` (the shared experts give their own)."""
        return {"experts.linear_fc1": (1, gate_up_rows(self.experts.ffn_hidden_size))}

    def muon_split_schema(self, prefix: str) -> dict[str, MuonSplit]:
        f = self.experts.ffn_hidden_size
        order = torch.argsort(gate_up_rows(f))
        schema = {f"{prefix}.experts.linear_fc1.weight": MuonSplit(1, [f, f], order)}
        if self.shared_experts is not None:
            schema.update(self.shared_experts.muon_split_schema(f"{prefix}.shared_experts"))
        return schema

    def flops_per_token(self, hidden_size: int) -> float:
        """Router plus the top-k active experts plus the shared experts."""
        f = self.experts.ffn_hidden_size
        flops = 2 * hidden_size * self.settings.num_experts + self.settings.top_k * 6 * hidden_size * f
        if self.shared_experts is not None:
            flops += self.shared_experts.flops_per_token(hidden_size)
        return flops


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every MoE layer of ``model`` (the one way expert parallelism, FSDP and the model find them)."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def routing_counts_group(model: nn.Module):
    """The group over which ``model``'s MoE layers sum their token counts (``bias_counts_group``: the data,
    context and tensor/sequence-parallel ranks, which route different tokens of the same layers); None when
    ``parallelize`` set none. The monitor sums its counts over it too, so they do not depend on the layout."""
    groups = []
    for moe in moe_layers(model):
        if not any(moe.bias_counts_group is g for g in groups):
            groups.append(moe.bias_counts_group)
    if len(groups) > 1:
        raise RuntimeError("the MoE layers of one model sum their counts over different groups (a bug)")
    return groups[0] if groups else None
