"""Pipeline parallel with ``torch.distributed.pipelining`` (schedules 1f1b, gpipe, interleaved_1f1b).

Each pipeline rank keeps one pruned copy of the model that holds only its layers (under their global
names, ``decoder.layers.5`` stays ``decoder.layers.5``, so checkpoints load into any layout), the
embedding on the first stage and the final norm and output layer on the last. Its virtual stages
(``pipeline_parallel_interleave_num`` of them, stage ``c·pp + rank``) are light wrappers around
slices of that copy.

The trainer's step calls the model once per micro-batch and backpropagates each result. The pipeline
model accepts those calls, keeps the micro-batches, and at the last one (micro-batches = accumulation
steps, as in the original) runs the whole schedule, forward and backward. Each micro-batch's loss is
``loss_sum / N_global`` (the global-batch token mean, DESIGN §6), with ``scale_grads=False``. The
returned outputs carry the token counts and, on the last call, the step's summed loss broadcast from
the last stage, attached to a dummy leaf so the trainer's ``backward()`` is a no-op. MoE balancing
losses are added to the gradient where they arise (their layer's output), as Megatron's auto-scaler.
"""

from __future__ import annotations

import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError, NotSupportedError
from lmforge.parallel.pp_layout import stage_layers, stages_of_rank

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
IGNORE_INDEX = -100


class KeyedLayers(nn.ModuleDict):
    """A ModuleDict keyed by global layer id that iterates over its layers like a ModuleList."""

    def __iter__(self):
        return iter(self._modules.values())


class _AttachAux(torch.autograd.Function):
    """Returns ``h`` unchanged; in backward, seeds ``aux`` with gradient 1 (its scale is in ``aux``)."""

    @staticmethod
    def forward(ctx, h, aux):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


@dataclass
class _StepInputs:
    """Per-step side inputs of the stages (positions, masks), consumed one micro-batch at a time."""

    extras: deque = field(default_factory=deque)


class StageModule(nn.Module):
    """One virtual stage: embedding (first), a run of decoder layers, final norm + logits (last)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.layers = nn.ModuleList(model.decoder.layers[str(i)] for i in layer_ids)
        self.embedding = model.embedding if first else None
        self.final_layernorm = model.decoder.final_layernorm if last else None
        self.output_layer = getattr(model, "output_layer", None) if last else None
        object.__setattr__(self, "_model", model)  # not a submodule: no second name for its parameters
        self.side = _StepInputs()
        self.aux_scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin, allowed = self.side.extras.popleft()
        h = self.embedding.word_embeddings(x) if self.first else x
        for layer in self.layers:
            h = layer(h, cos, sin, allowed)
            aux = getattr(getattr(layer, "mlp", None), "last_aux_loss", None)
            if aux is not None and torch.is_grad_enabled():
                h = _AttachAux.apply(h, aux * self.aux_scale)
        if self.last:
            model = self._model
            return F.linear(model.decoder.final_layernorm(h), model._output_weight())
        return h


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}[name]


def validate_pp_options(opts: dict[str, Any], pp: int) -> tuple[str, int]:
    schedule = opts["pipeline_parallel_schedule"]
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule must be one of {list(SCHEDULES)}, got {schedule!r}."
        )
    interleave = opts["pipeline_parallel_interleave_num"]
    if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_interleave_num must be a positive integer, got {interleave!r}."
        )
    if pp > 1 and interleave > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(
            f"parallelism.pipeline_parallel_interleave_num={interleave} needs "
            f"parallelism.pipeline_parallel_schedule: interleaved_1f1b (got {schedule!r})."
        )
    return schedule, interleave


def split_for_pipeline(
    model: nn.Module, *, pp_rank: int, pp: int, opts: dict[str, Any]
) -> list[tuple[int, list[int]]]:
    """Prune ``model`` in place to this rank's layers; return ``(stage_id, layer_ids)`` of its stages."""
    schedule, interleave = validate_pp_options(opts, pp)
    if getattr(model, "mtp", None) is not None:
        raise NotSupportedError(
            "parallelism.pipeline_parallel > 1 with multi-token prediction (model mtp_num_layers > 0) is not "
            "supported yet; set one of them off."
        )
    num_layers = len(model.decoder.layers)
    stages = stage_layers(
        opts["pipeline_parallel_layers_per_stage"], num_layers=num_layers, pp=pp, interleave=interleave
    )
    n_stages = pp * interleave
    mine = stages_of_rank(pp_rank, pp, interleave)
    keep = sorted(i for s in mine for i in stages[s])
    layers = model.decoder.layers
    model.decoder.layers = KeyedLayers({str(i): layers[i] for i in keep})
    if 0 not in mine:
        model.embedding.word_embeddings = None
    if n_stages - 1 not in mine:
        model.decoder.final_layernorm = None
        model.output_layer = None
    return [(s, stages[s]) for s in mine]


class PipelineRunner:
    """Builds the stages and the schedule, and runs one step over the buffered micro-batches."""

    def __init__(
        self,
        model: nn.Module,
        stage_specs: list[tuple[int, list[int]]],
        *,
        pp_mesh: Any,
        dp_group: Any,
        n_stages: int,
        schedule: str,
        num_microbatches: int,
        device: torch.device,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.model = model
        self.pp_group = pp_mesh.get_group()
        self.dp_group = dp_group
        self.n_micro = num_microbatches
        self.device = device
        self.compute_dtype = compute_dtype
        self.loss_scale = 1.0  # fp16 dynamic loss scale of the step in progress (set by TrainStep)
        self.modules = [StageModule(model, ids, s == 0, s == n_stages - 1) for s, ids in stage_specs]
        self.has_first = any(m.first for m in self.modules)
        self.has_last = any(m.last for m in self.modules)
        self.stage_modules = self.modules
        self._stage_ids = [s for s, _ in stage_specs]
        self._n_stages = n_stages
        self._schedule_name = schedule
        self._schedule = None
        self._pipeline_stage = PipelineStage
        self.inv_tokens = 1.0
        self.loss_sums: list[torch.Tensor] = []
        self.tied: Any = None  # pp_tied.TiedOutput when the output layer is the embedding
        # Global rank of the last stage in this rank's pipeline (for broadcasting the loss).
        last_pp_rank = (n_stages - 1) % pp_mesh.size()
        self.last_stage_global_rank = dist.get_global_rank(self.pp_group, last_pp_rank)
        if schedule != "interleaved_1f1b" and len(stage_specs) != 1:
            raise ConfigError("parallelism.pipeline_parallel_schedule 1f1b/gpipe hold one stage per rank.")
        if schedule == "interleaved_1f1b" and num_microbatches % pp_mesh.size():
            raise ConfigError(
                f"parallelism.pipeline_parallel_schedule: interleaved_1f1b needs the number of micro-batches "
                f"(accumulation steps = {num_microbatches}) to be a multiple of parallelism.pipeline_parallel "
                f"({pp_mesh.size()}); adjust training.global_batch_size."
            )

    def _build(self) -> None:
        stages = [
            self._pipeline_stage(m, sid, self._n_stages, self.device, group=self.pp_group)
            for m, sid in zip(self.modules, self._stage_ids)
        ]
        cls = _schedule_class(self._schedule_name)
        target = stages if self._schedule_name == "interleaved_1f1b" else stages[0]
        self._schedule = cls(target, n_microbatches=self.n_micro, loss_fn=self._loss_fn, scale_grads=False)

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from lmforge.models.common.gpt import token_cross_entropy

        loss_sum, _ = token_cross_entropy(logits, target[..., 0], target[..., 1])
        self.loss_sums.append(loss_sum.detach())
        return loss_sum * self.inv_tokens

    def run(self, micro_batches: list[dict[str, torch.Tensor]], aux_scale: float) -> torch.Tensor:
        """Forward + backward of the whole step; returns the summed token loss (same on every pp rank)."""
        from lmforge.models.common.masks import build_allowed_mask

        first_run = self._schedule is None
        if first_run:
            self._build()
        counts = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in micro_batches:
            counts += _valid_tokens(b).to(torch.float64)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(counts, group=self.dp_group)
        # The backward runs inside the schedule, so the step's fp16 loss scale is applied here.
        self.inv_tokens = self.loss_scale / max(float(counts), 1.0)
        for m in self.modules:
            m.side.extras.clear()
            m.aux_scale = aux_scale * self.loss_scale
            for b in micro_batches:
                ids = b["input_ids"]
                s = ids.shape[1]
                pos = b.get("position_ids")
                if pos is None:
                    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
                elif pos.dim() == 1:
                    pos = pos.unsqueeze(0)
                cos, sin = self.model.rotary_pos_emb(pos)
                allowed = build_allowed_mask(s, ids.device, b.get("attention_mask"), b.get("actual_seq_len"))
                m.side.extras.append((cos, sin, allowed))
            if first_run:
                # torch infers the stage shapes on the first step by running each stage once more before
                # the micro-batches (and the loss once); give that run the first micro-batch's inputs.
                m.side.extras.appendleft(m.side.extras[0])
        self.loss_sums = []
        x = torch.cat([b["input_ids"] for b in micro_batches]) if self.has_first else None
        target = None
        if self.has_last:
            labels = torch.cat([b["labels"] for b in micro_batches])
            mask = [b.get("loss_mask") for b in micro_batches]
            mask = torch.cat(
                [
                    torch.ones_like(b["labels"]) if m is None else m.to(b["labels"].dtype)
                    for b, m in zip(micro_batches, mask)
                ]
            )
            target = torch.stack([labels.long(), mask.long()], dim=-1)
        if self.tied is not None:
            self.tied.send_weight(requires_grad=True)
        if self.has_first and self.has_last:
            self._schedule.step(x, target=target, losses=[])
        elif self.has_first:
            self._schedule.step(x)
        elif self.has_last:
            self._schedule.step(target=target, losses=[])
        else:
            self._schedule.step()
        if self.tied is not None:
            self.tied.return_grad()
        # Only the last n_micro loss calls are the micro-batches (the first step adds a shape-inference call).
        self.loss_sums = self.loss_sums[-self.n_micro :]
        total = torch.stack(self.loss_sums).sum() if self.loss_sums else torch.zeros((), device=self.device)
        total = total.to(torch.float32).reshape(1).clone()
        dist.broadcast(total, src=self.last_stage_global_rank, group=self.pp_group)
        return total[0]

    @torch.no_grad()
    def forward_only(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation: one micro-batch through the stages in order (plain send/recv, no schedule).

        Returns ``(loss_sum, num_tokens)`` of the batch, the same on every pipeline rank.
        """
        from lmforge.models.common.gpt import token_cross_entropy
        from lmforge.models.common.masks import build_allowed_mask

        ids = batch["input_ids"]
        b, s = ids.shape
        pos = batch.get("position_ids")
        if pos is None:
            pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, -1)
        elif pos.dim() == 1:
            pos = pos.unsqueeze(0)
        cos, sin = self.model.rotary_pos_emb(pos)
        allowed = build_allowed_mask(s, ids.device, batch.get("attention_mask"), batch.get("actual_seq_len"))
        pp = dist.get_world_size(self.pp_group)
        my_rank = dist.get_rank(self.pp_group)
        tp = getattr(self.model, "tensor_parallel_size", 1)
        hidden_shape = (b, s // tp, self.model.config.hidden_size)
        by_id = dict(zip(self._stage_ids, self.modules))
        if self.tied is not None:
            self.tied.send_weight(requires_grad=False)
        result = torch.zeros(2, dtype=torch.float32, device=self.device)
        h = None
        for sid in range(self._n_stages):
            owner = sid % pp
            if owner != my_rank:
                continue
            module = by_id[sid]
            if sid == 0:
                x = ids
            else:
                x = torch.empty(hidden_shape, dtype=self.compute_dtype, device=self.device)
                dist.recv(x, group_src=(sid - 1) % pp, group=self.pp_group)
            module.side.extras.clear()
            module.side.extras.append((cos, sin, allowed))
            h = module(x)
            if sid < self._n_stages - 1:
                dist.send(
                    h.to(self.compute_dtype).contiguous(), group_dst=(sid + 1) % pp, group=self.pp_group
                )
            else:
                mask = batch.get("loss_mask")
                loss_sum, num = token_cross_entropy(h, batch["labels"], mask)
                result = torch.stack([loss_sum.float(), num.float()])
        dist.broadcast(result, src=self.last_stage_global_rank, group=self.pp_group)
        return result[0], result[1]


def _valid_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    valid = batch["labels"] != IGNORE_INDEX
    mask = batch.get("loss_mask")
    if mask is not None:
        valid = valid & (mask != 0)
    return valid.sum()


def install_deferred_forward(model: nn.Module, runner: PipelineRunner, *, aux_scale: float) -> None:
    """Make ``model(**micro_batch)`` collect micro-batches and run the pipeline at the last one."""
    from lmforge.models.common.gpt import CausalLMOutput

    pending: list[dict[str, torch.Tensor]] = []
    anchor = torch.zeros((), requires_grad=True)

    def forward(
        self,
        input_ids,
        labels=None,
        loss_mask=None,
        position_ids=None,
        attention_mask=None,
        actual_seq_len=None,
    ):
        batch = {"input_ids": input_ids, "labels": labels}
        for key, value in (
            ("loss_mask", loss_mask),
            ("position_ids", position_ids),
            ("attention_mask", attention_mask),
            ("actual_seq_len", actual_seq_len),
        ):
            if value is not None:
                batch[key] = value
        if labels is None:
            raise ConfigError(
                "a pipeline-parallel model computes losses only (labels are required); generation and logits "
                "need parallelism.pipeline_parallel: 1."
            )
        if not torch.is_grad_enabled():  # evaluation: forward only, one micro-batch at a time
            loss_sum, num = runner.forward_only(batch)
            return CausalLMOutput(
                logits=torch.empty(0, device=input_ids.device),
                loss=loss_sum / num.clamp(min=1),
                loss_sum=loss_sum,
                num_tokens=num,
            )
        pending.append(batch)
        num = _valid_tokens(batch).to(torch.float32)
        a = anchor.to(input_ids.device)
        if len(pending) < runner.n_micro:
            loss_sum = a * 0.0
        else:
            total = runner.run(list(pending), aux_scale)
            pending.clear()
            loss_sum = total.detach() + a * 0.0
        return CausalLMOutput(
            logits=torch.empty(0, device=input_ids.device),
            loss=loss_sum / num.clamp(min=1),
            loss_sum=loss_sum,
            num_tokens=num,
        )

    model.forward = types.MethodType(forward, model)
    model.pipeline_runner = runner
