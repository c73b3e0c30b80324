"""One training step: micro-batches, backward, global-norm clipping, update — or a reported skip.

The loss of a step is the mean over every valid label token of the global batch (all micro-batches
on all data-parallel ranks), not a mean of micro-batch means: each micro-batch backpropagates
``loss_sum / N_global``, where ``N_global`` is counted before the first forward. Auxiliary losses
(MoE balancing, MTP) are averaged over micro-batches and ranks, as in the original.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.errors import TrainingFailed
from lmforge.models.common.loss import loss_gradient_scale
from lmforge.optim.update_rule import UpdateRuleOptimizer
from lmforge.train.loss_scale import LossScaler
from lmforge.train.parallel_seam import ParallelContext

CLIP_EPS = 1e-6  # coef = max_norm / (norm + eps), as the original
MODEL_INPUTS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "actual_seq_len")


class TrainingStopped(TrainingFailed):
    """Training could not go on, or trained nothing: too many consecutive skipped steps, recovery gave up, or
    no step of the run applied its update (exit status 5, lmforge.errors.EXIT_TRAINING_FAILED)."""


@dataclass
class SkipPolicy:
    """When to skip an update (``monitor.health_checkpoint``) and when to give up.

    A non-finite loss or gradient norm always skips. When the file enables
    ``monitor.health_checkpoint``, a finite global gradient norm above ``grad_norm_threshold``, or
    an embedding gradient norm above ``embedding_norm_threshold``, skips too (the original declares
    these thresholds but never reads them). After ``max_consecutive`` consecutive skips training
    stops (0: never stop).
    """

    grad_norm_threshold: float = math.inf
    embedding_norm_threshold: float = math.inf
    max_consecutive: int = 10
    spike_skipping: bool = False  # whether monitor.health_checkpoint was written (for messages)

    @classmethod
    def from_monitor(cls, monitor: Any) -> SkipPolicy:
        """The policy the ``monitor`` section asks for.

        Spike skipping is opt-in: the spec turns a feature off when its section is omitted, and
        without it the step clips and applies. Only a written ``monitor.health_checkpoint`` (even
        an empty one, which takes the defaults 100 / 100 / 10) enables the thresholds; non-finite
        steps are skipped either way, and 10 of them in a row stop the run.
        """
        written = getattr(monitor, "model_fields_set", None)
        if monitor is None or written is None or "health_checkpoint" not in written:
            return cls()
        health = monitor.health_checkpoint
        return cls(
            grad_norm_threshold=float(health.global_norm_skip_threshold),
            embedding_norm_threshold=float(health.embedding_local_norm_threshold),
            max_consecutive=int(health.global_norm_skip_time),
            spike_skipping=True,
        )


@dataclass
class StepResult:
    loss: float  # mean LM loss over the valid tokens of the global batch
    grad_norm: float  # global L2 norm before clipping
    lr: float  # lr of this update (before lr_scale)
    num_tokens: int  # valid (loss-bearing) label tokens of the global batch
    input_tokens: int  # all input tokens of the global batch
    samples: int  # samples of the global batch
    aux_losses: dict[str, float] = field(default_factory=dict)
    embedding_grad_norm: float | None = None
    skipped: bool = False
    skip_reason: str | None = None
    loss_scale: float | None = None  # the fp16 loss scale this step used (None: no scaling)
    overflow: bool = False  # skipped because the scaled fp16 gradients overflowed


def count_loss_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss weight of a batch, as the models count it: labels >= 0 (so -100 is ignored), each
    weighted by its loss_mask value (1/0 in practice)."""
    weights = (batch["labels"] >= 0).to(torch.float64)
    mask = batch.get("loss_mask")
    if mask is not None:
        weights = weights * mask.to(torch.float64)
    return weights.sum()


def grad_norms(
    params: Iterable[torch.Tensor], ctx: ParallelContext, subset: Iterable[torch.Tensor] = ()
) -> torch.Tensor:
    """``[norm of all gradients, norm of those of subset]`` (L2, over every rank), from one pass.

    DTensor-aware: a shard replicated on k ranks counts once. ``subset``'s parameters must be among
    ``params``; its norm (the embedding's, for the skip policy) comes from the same per-tensor norms, so
    its gradients are not read twice and both norms share one all-reduce."""
    in_subset = {id(p) for p in subset}
    # Squared norms grouped by how many ranks hold the same values (plain tensors: every rank);
    # per-tensor norms come from one fused kernel per group (as torch's clip_grad_norm_).
    groups: dict[tuple[int, torch.device, torch.dtype], list[tuple[torch.Tensor, bool]]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local") and hasattr(g, "placements"):
            local = g.to_local()
            factor = 1
            for dim, placement in enumerate(g.placements):
                if placement.is_replicate():
                    factor *= g.device_mesh.size(dim)
        else:
            local = g
            factor = ctx.world_size  # a plain tensor is a full replica on every rank
        if local.numel():
            groups.setdefault((factor, local.device, local.dtype), []).append((local, id(p) in in_subset))
    totals = torch.zeros(2, dtype=torch.float32, device=ctx.device)
    for (factor, _device, _dtype), entries in groups.items():
        tensors = [t for t, _ in entries]
        if _dtype in (torch.float32, torch.float64):
            norms = torch._foreach_norm(tensors)
        else:  # low-precision grads (a model outside the trainer's FSDP2): accumulate each norm in fp32
            norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
        sq = torch.stack([n.to(device=ctx.device, dtype=torch.float32) for n in norms]).square() / factor
        mask = torch.tensor([marked for _, marked in entries], device=ctx.device)
        # where, not a product: an inf/nan outside the subset must not turn the subset's norm into nan.
        totals = totals + torch.stack([sq.sum(), torch.where(mask, sq, 0.0).sum()])
    if ctx.distributed:
        dist.all_reduce(totals)
    return totals.sqrt()


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
    }


class TrainStep:
    """Runs one optimizer step over a list of micro-batches (one rank's share of the global batch)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any,
        *,
        max_norm: float,
        ctx: ParallelContext,
        skip_policy: SkipPolicy | None = None,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_norm = float(max_norm)
        self.ctx = ctx
        self.skip_policy = skip_policy or SkipPolicy()
        self.loss_scaler = loss_scaler
        named = list(model.named_parameters())
        self.params = [p for _, p in named if p.requires_grad]
        self.embedding_params = [p for n, p in named if p.requires_grad and "word_embeddings" in n]

    def __call__(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> StepResult:
        ctx = self.ctx
        batches = [_to_device(b, ctx.device) for b in micro_batches]
        counts, n_global, input_tokens, samples = self._global_counts(batches)
        # fp16: backpropagate loss x scale (gradients divided by it again before clipping).
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        loss_sum, model_tokens, aux_totals = self._forward_backward(batches, n_global, loss_scale)
        if not torch.equal(model_tokens, counts.sum()):
            raise RuntimeError(
                f"the model counted {float(model_tokens)} loss tokens but the trainer counted {float(counts.sum())} "
                "(labels >= 0, weighted by loss_mask): the model's loss masking disagrees with the trainer's"
            )
        loss, aux_losses = self._reduced_losses(loss_sum, aux_totals, n_global)

        # One pass and one reduction for both norms; every rank joins it (under pipeline parallel only the
        # first stage holds the embedding).
        norms = grad_norms(self.params, ctx, self.embedding_params).tolist()
        grad_norm = norms[0] / loss_scale
        emb_norm = norms[1] / loss_scale if (self.embedding_params or ctx.distributed) else None
        result = StepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=self._current_lr(),
            num_tokens=int(n_global),
            input_tokens=int(input_tokens),
            samples=int(samples),
            aux_losses=aux_losses,
            embedding_grad_norm=emb_norm,
            loss_scale=self.loss_scaler.scale if self.loss_scaler is not None else None,
        )
        reason = self._skip_or_scale(result)
        if reason is not None:
            # Nothing is applied: gradients are dropped; the lr schedule and the optimizer's step
            # counter stay where they are, so the next update gets the lr this one would have had.
            self.optimizer.zero_grad(set_to_none=True)
            result.skipped, result.skip_reason = True, reason
            return result
        self._update(grad_norm, loss_scale)
        return result

    def _global_counts(self, batches: list[dict[str, Any]]) -> tuple[torch.Tensor, float, float, float]:
        """(this rank's loss tokens per micro-batch, and over the global batch: loss tokens, input tokens,
        samples), counted before the first forward."""
        device = self.ctx.device
        counts = torch.stack([count_loss_tokens(b) for b in batches]).to(torch.float64)
        local_stats = torch.stack(
            [
                counts.sum(),
                torch.tensor(
                    float(sum(b["input_ids"].numel() for b in batches)), dtype=torch.float64, device=device
                ),
                torch.tensor(
                    float(sum(b["input_ids"].shape[0] for b in batches)), dtype=torch.float64, device=device
                ),
            ]
        )
        if self.ctx.distributed:
            dist.all_reduce(local_stats, group=self.ctx.dp_group)
        n_global, input_tokens, samples = (float(x) for x in local_stats.tolist())
        return counts, n_global, input_tokens, samples

    def _forward_backward(
        self, batches: list[dict[str, Any]], n_global: float, loss_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of every micro-batch: (loss sum, loss tokens the model counted, the
        auxiliary losses averaged over micro-batches) on this rank."""
        ctx, device, accum = self.ctx, self.ctx.device, len(batches)
        # FSDP2 sums gradients over data-parallel ranks: each rank's objective is already divided by the
        # global token count, so the sum is the gradient of the global-batch token mean.
        inv_tokens = loss_scale / max(n_global, 1.0)
        aux_scale = loss_scale / (accum * ctx.dp_size)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        model_tokens = torch.zeros((), dtype=torch.float64, device=device)
        aux_totals: dict[str, torch.Tensor] = {}
        pipeline = ctx.pipeline
        if pipeline is not None:
            # Pipeline parallel: the schedule runs forward and backward of every micro-batch; each
            # backpropagates loss_sum × inv_tokens, and the balancing losses enter where they arise.
            args, kwargs = pipeline.step_inputs(batches, scale=inv_tokens, aux_scale=aux_scale)
            pipeline.schedule.step(*args, **kwargs)
            pipe_loss, pipe_tokens, pipe_aux = (
                pipeline.finish_step()
            )  # (tied embedding gradients summed here)
            loss_sum += pipe_loss
            model_tokens += pipe_tokens
            aux_totals = {name: value / accum for name, value in pipe_aux.items()}
        for batch in batches if pipeline is None else ():  # (the pipeline ran them above)
            # The gradient of loss_sum below is inv_tokens: announced, the chunked loss folds it in forward.
            with loss_gradient_scale(inv_tokens):
                out = self.model(**{k: v for k, v in batch.items() if k in MODEL_INPUTS})
            objective = out.loss_sum * inv_tokens
            aux = getattr(out, "aux_loss", None)
            if isinstance(aux, torch.Tensor) and aux.requires_grad:
                # .loss = token mean + aux_loss (weighted auxiliary losses); the auxiliary part is
                # averaged over micro-batches and ranks (the original's 1/num_accum and 1/dp scaling).
                objective = objective + aux * aux_scale
            if getattr(out, "aux_losses", None):
                for name, value in out.aux_losses.items():
                    v = value.detach().to(torch.float64)
                    aux_totals[name] = aux_totals.get(name, 0) + v / accum
            objective.backward()
            loss_sum += out.loss_sum.detach().to(torch.float64)
            model_tokens += torch.as_tensor(out.num_tokens, device=device).to(torch.float64)
        return loss_sum, model_tokens, aux_totals

    def _reduced_losses(
        self, loss_sum: torch.Tensor, aux_totals: dict[str, torch.Tensor], n_global: float
    ) -> tuple[float, dict[str, float]]:
        """(the global batch's token-mean loss, each auxiliary loss averaged over the data-parallel ranks)."""
        reduced = torch.stack([loss_sum, *aux_totals.values()]) if aux_totals else loss_sum.reshape(1)
        if self.ctx.distributed:
            dist.all_reduce(reduced, group=self.ctx.dp_group)
        loss = float(reduced[0]) / max(n_global, 1.0)
        aux_losses = {k: float(v) / self.ctx.dp_size for k, v in zip(aux_totals, reduced[1:].tolist())}
        return loss, aux_losses

    def _skip_or_scale(self, result: StepResult) -> str | None:
        """Why this update is skipped (None: it is applied); under fp16, the loss scale updated."""
        reason = self._skip_reason(result)
        if self.loss_scaler is not None:
            # Overflow: the loss is finite but the scaled gradients are not (NaN/inf in backward).
            result.overflow = math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
            if result.overflow:
                old = self.loss_scaler.scale
                reason = f"float16 gradient overflow at loss scale {old:g} (lowered to {old * self.loss_scaler.backoff_factor:g})"
            if reason is None or result.overflow:
                self.loss_scaler.update(result.overflow)
        return reason

    def _update(self, grad_norm: float, loss_scale: float) -> None:
        """Clip (and unscale), step the optimizer and the schedule, update the expert biases."""
        # Clipping and, under fp16, unscaling: one factor. lmforge's optimizers fold it into the update
        # (AdamW: into its fused kernel), which saves a pass over every gradient; others get it applied.
        coef = min(1.0, self.max_norm / (grad_norm + CLIP_EPS)) / loss_scale
        if isinstance(self.optimizer, UpdateRuleOptimizer):
            self.optimizer.step(grad_scale=coef)
        else:
            if coef != 1.0:
                grads = [p.grad for p in self.params if p.grad is not None]
                torch._foreach_mul_(grads, coef)
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        update_bias = getattr(self.model, "update_expert_bias", None)
        if callable(update_bias):
            # Aux-loss-free balancing from the token counts of every rank that routed other tokens: each
            # MoE layer sums its counts over the group parallelize gave it (data, context and tensor/
            # sequence parallel ranks). Summing over data parallel only here missed the other ranks.
            update_bias()
        self.optimizer.zero_grad(set_to_none=True)

    def _current_lr(self) -> float:
        group = self.optimizer.param_groups[0]
        return float(group["lr"]) / float(group.get("lr_scale", 1.0) or 1.0)

    def _skip_reason(self, r: StepResult) -> str | None:
        policy = self.skip_policy
        if not math.isfinite(r.loss):
            return f"loss is {r.loss}"
        if not math.isfinite(r.grad_norm):
            return f"gradient norm is {r.grad_norm}"
        if r.grad_norm > policy.grad_norm_threshold:
            return (
                f"gradient norm {r.grad_norm:.4g} > monitor.health_checkpoint.global_norm_skip_threshold "
                f"{policy.grad_norm_threshold:g}"
            )
        if r.embedding_grad_norm is not None and r.embedding_grad_norm > policy.embedding_norm_threshold:
            return (
                f"embedding gradient norm {r.embedding_grad_norm:.4g} > "
                f"monitor.health_checkpoint.embedding_local_norm_threshold {policy.embedding_norm_threshold:g}"
            )
        return None
