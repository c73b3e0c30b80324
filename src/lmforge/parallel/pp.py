"""Pipeline parallel with ``torch.distributed.pipelining`` (schedules 1f1b, gpipe, interleaved_1f1b).

Each pipeline rank keeps one pruned copy of the model that holds only its layers (under their global
names, ``decoder.layers.5`` stays ``decoder.layers.5``, so checkpoints load into any layout), the
embedding on the first stage and the final norm, output layer and multi-token-prediction (MTP) layers
on the last. Its virtual stages
(``pipeline_parallel_interleave_num`` of them, stage ``c·pp + rank``) are :class:`StageModule` s: plain
modules over slices of that copy, each wrapped in a ``PipelineStage``.

The train step runs the schedule itself (as torchtitan's ``if pp: schedule.step(...)``):
:meth:`Pipeline.step_inputs` gives the whole-batch arguments of this rank's stages (micro-batches =
accumulation steps, as in the original), ``pipeline.schedule.step(...)`` runs forward and backward of
every micro-batch, and :meth:`Pipeline.finish_step` returns the tied gradient and the loss. The last
stage computes its micro-batch's loss itself, through the model's ``token_loss`` module (chunked by
``model.loss_chunk_size``: the ``[tokens, vocab]`` logits never exist whole; vocabulary-parallel under
tensor parallel), from the labels it receives as keyword arguments, and returns ``(CE sum, valid
tokens)``. The schedule's loss function (:class:`MicroBatchLossScale`) only backpropagates each
micro-batch's ``loss_sum × scale`` with ``scale = 1/N_global`` (times the fp16 loss scale): the
global-batch token mean of DESIGN §6, with ``scale_grads=False``.
MoE balancing losses are added to the gradient where they arise (their layer's output), as
Megatron's auto-scaler. MTP (DeepSeek-V3's layout): the last stage runs the model's own
``mtp_losses`` on its last hidden states after the main loss, with the micro-batch's input ids (a
keyword argument like the labels) and the embedding weight carried from the first stage
(:mod:`lmforge.parallel.pp_tied`); their weighted sum enters the gradient with the balancing losses'
weight (``aux_scale``), exactly as the unpipelined step adds ``aux_loss``, and the per-depth losses
(``mtp_k_loss``) come back for the log. Evaluation runs the stages forward-only, one micro-batch at a time
(:meth:`Pipeline.evaluate_batch`). Calling the pruned model directly is refused with a clear message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.errors import ConfigError
from lmforge.parallel.pp_layout import stage_layers, stages_of_rank

logger = logging.getLogger(__name__)

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
IGNORE_INDEX = -100
# Side inputs every stage receives as keyword arguments of ``schedule.step`` (split per micro-batch).
STAGE_KWARGS = ("position_ids", "attention_mask", "actual_seq_len")
# What the last stage's loss needs, given to the stages of the rank that holds it (also split per micro-batch);
# with multi-token prediction the input ids too (as ``mtp_input_ids``).
LOSS_KWARGS = ("labels", "loss_mask")


class KeyedLayers(nn.ModuleDict):
    """A ModuleDict keyed by global layer id that iterates over its layers like a ModuleList."""

    def __iter__(self):
        return iter(self._modules.values())


class _AttachAux(torch.autograd.Function):
    """Returns ``h`` unchanged; in backward, seeds ``aux`` with gradient 1 (its scale is in ``aux``).

    Not a collective (DTensor has nothing for it): the schedule backpropagates only a stage's output, so
    a balancing loss that arose inside the stage gets its gradient here, where its layer's output does.
    """

    @staticmethod
    def forward(ctx, h, aux):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class StageModule(nn.Module):
    """One virtual stage: embedding (first), a run of decoder layers, final norm + loss + MTP (last).

    Its submodules are the pruned model's own (one name, one parameter each). The last stage returns
    ``[CE sum, valid tokens, mtp_1_loss, ..., mtp_D_loss]`` (fp32) of its micro-batch, computed by the
    model's ``token_loss`` with the model's output weight, or, with tied embeddings, the first stage's
    embedding weight as received for this step (``last_embedding``, :mod:`lmforge.parallel.pp_tied`),
    which the MTP depths also look their tokens up in. The loss runs inside this forward, not
    in the schedule's loss function, so that the output weight is used inside the FSDP2 module that
    holds it (gathered by its pre-forward hook, its gradient reduce-scattered after backward) and the
    logits exist only one chunk at a time.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.layers = nn.ModuleList(model.decoder.layers[str(i)] for i in layer_ids)
        self.embedding = model.embedding if first else None
        self.final_layernorm = model.decoder.final_layernorm if last else None
        self.output_layer = getattr(model, "output_layer", None) if last else None
        self.mtp = getattr(model, "mtp", None) if last else None
        # Set on the last stage when it needs the embedding (tied output layer, MTP): see pp_tied.
        self.last_embedding: nn.Module | None = None
        object.__setattr__(self, "_model", model)  # not a submodule: no second name for its parameters
        self.aux_scale = 0.0  # weight of the MoE balancing losses in this step's objective
        self.loss_grad_scale = 1.0  # the gradient of the last stage's loss sum (MicroBatchLossScale's scale)
        self.aux_sum: torch.Tensor | float = 0.0  # this step's balancing losses (for the log)
        self.moe_layers = 0  # layers of this stage that produced a balancing loss in its last call
        # The schedule's first step infers the stage's shapes with one extra forward (on the first
        # micro-batch, or on uninitialised activations past the first stage). The pipeline sets this
        # flag before that step so that the extra run leaves no trace in the buffers (MoE token
        # counts, tracked max logits); ``calls`` lets it check that the extra run happened.
        self.restore_buffers_after_next_call = False
        self.calls = 0

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        actual_seq_len: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states for the next stage, or on the last stage ``[CE sum, valid tokens, MTP losses]``."""
        self.calls += 1
        loss_inputs = (labels, loss_mask, mtp_input_ids)
        if not self.restore_buffers_after_next_call:
            return self._run(x, position_ids, attention_mask, actual_seq_len, *loss_inputs)
        self.restore_buffers_after_next_call = False
        saved = [(b, _local(b).detach().clone()) for b in self.buffers()]
        aux_before = self.aux_sum
        out = self._run(x, position_ids, attention_mask, actual_seq_len, *loss_inputs)
        self.aux_sum = aux_before
        with torch.no_grad():
            for b, before in saved:
                if not torch.equal(_local(b), before):  # only counters change (in-place copy is safe)
                    _local(b).copy_(before)
        return out

    def _run(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        actual_seq_len: torch.Tensor | None,
        labels: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from lmforge.models.common.masks import attention_layout

        model = self._model
        cos, sin = model.rotary_pos_emb(position_ids)
        allowed = attention_layout(position_ids.shape[-1], x.device, attention_mask, actual_seq_len)
        h = self.embedding.word_embeddings(x) if self.first else x
        self.moe_layers = 0
        for layer in self.layers:
            h = layer(h, cos, sin, allowed)
            aux = self._balancing_loss(layer)
            if aux is not None:
                h = _AttachAux.apply(h, aux * self.aux_scale)
        if not self.last:
            return h
        if labels is None:
            raise ConfigError(
                "the last pipeline stage computes the loss and needs the micro-batch's labels (a pipeline-"
                "parallel model computes losses only; logits need parallelism.pipeline_parallel: 1)."
            )
        normed = self.final_layernorm(h)
        carried = self.last_embedding
        if carried is not None and carried.tied:
            weight = carried.output_weight()
        else:
            weight = model._stored_output_weight()  # a DTensor split by vocabulary rows under tp
        # The schedule's loss function backpropagates loss_sum × loss_grad_scale: announced to the chunked loss.
        scale = model.token_loss.grad_scale_kwargs(self.loss_grad_scale)
        loss_sum, count, _ = model.token_loss(normed, weight, labels, loss_mask, **scale)
        mtp_losses: list[torch.Tensor] = []
        if self.mtp is not None:
            weighted, mtp_losses = self._mtp(h, mtp_input_ids, labels, loss_mask, (cos, sin, allowed), weight)
            if torch.is_grad_enabled():
                # The unpipelined step backpropagates aux_loss × aux_scale beside the token-mean loss.
                loss_sum = _AttachAux.apply(loss_sum, weighted * self.aux_scale)
        return torch.stack([loss_sum, count.to(loss_sum.dtype), *mtp_losses])

    def _mtp(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor | None,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        rope_and_mask: tuple,
        output_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(weighted MTP losses plus the MTP layers' balancing losses, [mtp_1_loss, ..., mtp_D_loss]).

        The unpipelined model's own ``mtp_losses`` (same shifts, masks, depth weights); the embedding is
        the first stage's, carried here (the last stage holds no embedding parameter)."""
        if input_ids is None or self.last_embedding is None:
            raise RuntimeError("the last pipeline stage runs MTP without its input ids or embedding (a bug)")
        named: dict[str, torch.Tensor] = {}
        cos, sin, allowed = rope_and_mask
        weighted = self._model.mtp_losses(
            h, input_ids, labels, loss_mask, cos, sin, allowed, named,
            embed=self.last_embedding.lookup, output_weight=output_weight,
        )  # fmt: skip
        for depth in self.mtp.layers:
            aux = self._balancing_loss(depth.transformer_layer)
            if aux is not None:
                weighted = weighted + aux
        return weighted, [named[f"mtp_{k}_loss"].detach().float() for k in range(1, len(self.mtp.layers) + 1)]

    def _balancing_loss(self, layer: nn.Module) -> torch.Tensor | None:
        """The MoE balancing loss ``layer`` produced in this forward (counted for the log), or None; only
        while gradients are recorded (evaluation adds none)."""
        aux = getattr(getattr(layer, "mlp", None), "last_aux_loss", None)
        if aux is None or not torch.is_grad_enabled():
            return None
        self.aux_sum = self.aux_sum + aux.detach().to(torch.float64)
        self.moe_layers += 1
        return aux


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MicroBatchLossScale:
    """The schedule's loss function: scales the last stage's output, a micro-batch's ``[CE sum over its
    valid tokens, valid tokens, MTP losses]``, to the micro-batch's part of the step's objective,
    ``CE sum × scale`` (the MTP losses are already in its gradient, see :class:`StageModule`).

    ``scale`` (a ``loss_kwargs`` entry of ``schedule.step``) is ``1 / N_global`` times the fp16 loss
    scale, so the micro-batches' backward passes add up to the gradient of the global-batch token mean.
    The unscaled sums and token counts are kept for the step's reported loss. The ``target`` that torch's
    schedules pass is unused (the stage already had the labels).
    """

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.mtp: list[torch.Tensor] = []  # per micro-batch: [mtp_1_loss, ..., mtp_D_loss]

    def clear(self) -> None:
        self.sums.clear()
        self.tokens.clear()
        self.mtp.clear()

    def __call__(self, output: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.sums.append(output[0].detach())
        self.tokens.append(output[1].detach())
        self.mtp.append(output[2:].detach())
        return output[0] * scale


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
        # The MTP layers live on the last stage: they continue from its hidden states (DeepSeek-V3's layout).
        model.decoder.final_layernorm = None
        model.output_layer = None
        if getattr(model, "mtp", None) is not None:
            model.mtp = None
    return [(s, stages[s]) for s in mine]


class Pipeline:
    """This rank's stages and their schedule; the train step calls ``schedule.step`` between
    :meth:`step_inputs` and :meth:`finish_step`."""

    def __init__(
        self,
        model: nn.Module,
        stage_specs: list[tuple[int, list[int]]],
        *,
        pp_mesh: Any,
        cp_mesh: Any,
        n_stages: int,
        schedule: str,
        num_microbatches: int,
        device: torch.device,
        compute_dtype: torch.dtype = torch.float32,
        check_batch: Callable[[torch.Tensor], None] | None = None,
        tp_size: int = 1,
    ) -> None:
        self.model = model
        self.tp_size = tp_size  # sequence parallel: activations between stages hold 1/tp of the sequence
        self.pp_group = pp_mesh.get_group()
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        self.cp_group = cp_mesh.get_group() if self.cp_size > 1 else None
        self.n_micro = num_microbatches
        self.device = device
        self.compute_dtype = compute_dtype
        self.check_batch = check_batch  # e.g. the sequence length against tp / cp
        self.stage_modules = [StageModule(model, ids, s == 0, s == n_stages - 1) for s, ids in stage_specs]
        self.has_first = any(m.first for m in self.stage_modules)
        self.has_last = any(m.last for m in self.stage_modules)
        self.loss = MicroBatchLossScale()
        self.tied: Any = None  # pp_tied.LastStageEmbedding when the last stage needs the embedding
        # MTP depths of the model (on every pipeline rank: their losses are shared with all of them).
        self.mtp_depth = int(getattr(getattr(model, "config", None), "mtp_num_layers", 0) or 0)
        self._stage_ids = [s for s, _ in stage_specs]
        self._n_stages = n_stages
        self._schedule_name = schedule
        self._schedule: Any = None
        self._first_step = False
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

    def attach_last_stage_embedding(self, carried: Any) -> None:
        """Tied embeddings or MTP: the last stage uses ``carried``'s copy of the embedding weight."""
        self.tied = carried
        for m in self.stage_modules:
            if m.last:
                m.last_embedding = carried

    @property
    def schedule(self) -> Any:
        """The ``torch.distributed.pipelining`` schedule (built at first use, on the materialised model)."""
        if self._schedule is None:
            from torch.distributed.pipelining import PipelineStage

            stages = [
                PipelineStage(m, sid, self._n_stages, self.device, group=self.pp_group)
                for m, sid in zip(self.stage_modules, self._stage_ids)
            ]
            cls = _schedule_class(self._schedule_name)
            target = stages if self._schedule_name == "interleaved_1f1b" else stages[0]
            self._schedule = cls(target, n_microbatches=self.n_micro, loss_fn=self.loss, scale_grads=False)
        return self._schedule

    def _local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a micro-batch (its context-parallel chunks), with explicit positions."""
        from lmforge.parallel.cp import shard_batch

        ids = batch["input_ids"]
        if self.check_batch is not None:
            self.check_batch(ids)
        batch = shard_batch(batch, self.cp_size, self.cp_rank, None)
        pos = batch.get("position_ids")
        if pos is None:
            s = batch["input_ids"].shape[1]
            pos = torch.arange(s, device=ids.device).unsqueeze(0)
        elif pos.dim() == 1:
            pos = pos.unsqueeze(0)
        return {**batch, "position_ids": pos.expand(batch["input_ids"].shape[0], -1)}

    def step_inputs(
        self, micro_batches: Sequence[dict[str, torch.Tensor]], *, scale: float, aux_scale: float
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """``(args, kwargs)`` of ``schedule.step`` for this rank's stages, over the step's micro-batches.

        ``scale`` multiplies each micro-batch's loss sum (``1/N_global`` × the fp16 loss scale);
        ``aux_scale`` weighs the balancing losses as the non-pipelined step does (under context
        parallel each rank's chunk pair contributes ``1/cp`` of it). With tied embeddings this sends
        the weight to the last stage (see :meth:`finish_step` for its gradient).
        """
        if len(micro_batches) != self.n_micro:
            raise ConfigError(
                f"pipeline parallel runs {self.n_micro} micro-batches per step (the accumulation steps it was "
                f"built for), got {len(micro_batches)}; the global batch must not change during the run."
            )
        local = [self._local_batch(b) for b in micro_batches]
        self._first_step = self._schedule is None
        for m in self.stage_modules:
            m.aux_scale = aux_scale / self.cp_size
            m.loss_grad_scale = scale
            m.aux_sum = 0.0
            m.calls = 0
            m.restore_buffers_after_next_call = self._first_step  # the schedule's shape inference
        self.loss.clear()
        kwargs: dict[str, Any] = {
            key: torch.cat([b[key] for b in local]) for key in STAGE_KWARGS if local[0].get(key) is not None
        }
        # The stages' outputs are not kept for a return value (on the last stage they are the losses, which
        # the loss function keeps).
        kwargs["return_outputs"] = False
        if self.has_last:
            kwargs["labels"] = torch.cat([b["labels"] for b in local])
            if self.mtp_depth:  # the MTP depths look up the shifted input tokens
                kwargs["mtp_input_ids"] = torch.cat([b["input_ids"] for b in local])
            masks = [b.get("loss_mask") for b in local]
            given = next((m for m in masks if m is not None), None)
            if given is not None:
                kwargs["loss_mask"] = torch.cat([torch.ones_like(given) if m is None else m for m in masks])
            # torch's schedules require a target per micro-batch for the last stage's loss function; the
            # stage has already computed the loss from the labels, so this one is a placeholder.
            kwargs["target"] = torch.zeros(self.n_micro, device=self.device)
            kwargs["loss_kwargs"] = {"scale": scale}
        if self.tied is not None:
            self.tied.send_weight(requires_grad=True)
        args = (torch.cat([b["input_ids"] for b in local]),) if self.has_first else ()
        return args, kwargs

    def finish_step(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """After ``schedule.step``: the tied weight's gradient goes back to the first stage, and
        ``(loss_sum, tokens, aux_losses)`` of this data-parallel rank's micro-batches is returned, the
        same on every pipeline rank: the loss sum and token count from the last stage (summed over
        context-parallel ranks), ``aux_losses`` the MoE balancing losses of every stage's layers
        and the last stage's ``mtp_k_loss``, summed over micro-batches (averaged over cp chunks), for
        the log, as the model reports them."""
        if self.tied is not None:
            self.tied.return_grad()
        if self._first_step and any(m.calls != self.n_micro + 1 for m in self.stage_modules):
            logger.warning(
                "torch.distributed.pipelining ran %s stage forwards in its first step, not one per micro-batch "
                "(%d) plus one to infer shapes: the buffers restored after the first forward (MoE token counts, "
                "max logits) missed one micro-batch; lmforge.parallel.pp must follow this torch version.",
                [m.calls for m in self.stage_modules],
                self.n_micro,
            )
        self._first_step = False
        # Only the last n_micro loss calls are the micro-batches (the first step infers shapes with one more).
        sums, tokens = self.loss.sums[-self.n_micro :], self.loss.tokens[-self.n_micro :]
        totals = torch.zeros(4 + self.mtp_depth, dtype=torch.float64, device=self.device)
        if self.has_last:
            totals[0] = torch.stack(sums).to(torch.float64).sum()
            totals[1] = torch.stack(tokens).to(torch.float64).sum()
            if self.mtp_depth:
                totals[4:] = torch.stack(self.loss.mtp[-self.n_micro :]).to(torch.float64).sum(0)
        for m in self.stage_modules:
            totals[2] += torch.as_tensor(m.aux_sum, device=self.device) / self.cp_size
        totals[3] = sum(m.moe_layers for m in self.stage_modules)
        if self.cp_group is not None:
            dist.all_reduce(totals, group=self.cp_group)
        # Loss and tokens are zero outside the last stage, so the sum over pp ranks is its value.
        dist.all_reduce(totals, group=self.pp_group)
        aux = {f"mtp_{k}_loss": totals[3 + k] for k in range(1, self.mtp_depth + 1)}
        if totals[3] > 0:
            aux["load_balancing_loss"] = totals[2]
        return totals[0], totals[1], aux

    def _share_totals(self, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cp_group is not None:
            dist.all_reduce(totals, group=self.cp_group)
        dist.broadcast(totals, src=self.last_stage_global_rank, group=self.pp_group)
        return totals[0], totals[1]

    @torch.no_grad()
    def evaluate_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation: one micro-batch through the stages in order (plain send/recv, no schedule).

        Returns ``(loss_sum, num_tokens)`` of the batch, the same on every pipeline rank.
        """
        if batch.get("labels") is None:
            raise ConfigError(
                "a pipeline-parallel model computes losses only (labels are required); generation and logits "
                "need parallelism.pipeline_parallel: 1."
            )
        batch = self._local_batch(batch)
        ids = batch["input_ids"]
        b, s = ids.shape
        side = {key: batch[key] for key in STAGE_KWARGS if batch.get(key) is not None}
        pp = dist.get_world_size(self.pp_group)
        my_rank = dist.get_rank(self.pp_group)
        hidden_shape = (b, s // self.tp_size, self.model.config.hidden_size)
        by_id = dict(zip(self._stage_ids, self.stage_modules))
        if self.tied is not None:
            self.tied.send_weight(requires_grad=False)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for sid in range(self._n_stages):
            if sid % pp != my_rank:
                continue
            if sid == 0:
                x = ids
            else:
                x = torch.empty(hidden_shape, dtype=self.compute_dtype, device=self.device)
                dist.recv(x, group_src=(sid - 1) % pp, group=self.pp_group)
            if sid < self._n_stages - 1:
                h = by_id[sid](x, **side)
                dist.send(
                    h.to(self.compute_dtype).contiguous(), group_dst=(sid + 1) % pp, group=self.pp_group
                )
            else:
                mtp_ids = ids if self.mtp_depth else None
                out = by_id[sid](
                    x, **side, labels=batch["labels"], loss_mask=batch.get("loss_mask"), mtp_input_ids=mtp_ids
                )
                totals = out[:2].to(torch.float64)  # the LM loss (as the unpipelined validation reads it)
        return self._share_totals(totals)


def refuse_direct_calls(model: nn.Module) -> None:
    """The pruned model holds only this rank's layers: only its pipeline may run it."""

    def pre_hook(mod, args, kwargs):
        raise ConfigError(
            "a pipeline-parallel model is run by its pipeline schedule (parallelize's ParallelInfo.pipeline, "
            "which the train step and evaluation take from ParallelContext.pipeline), not called directly; "
            "generation and logits need parallelism.pipeline_parallel: 1."
        )

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
