"""``parallelize``: apply the ``parallelism`` section to a model built on the meta device.

Order: pipeline split → expert parallel → tensor + sequence parallel → context parallel → activation
recompute / swap (a hook from ``parallel/activation.py``) → FSDP2. Then the caller materialises the model (``to_empty`` + ``init_weights`` or a checkpoint load).

Fields that are accepted without an effect (Ascend-specific overlap and fusion switches) warn once at
run time when set to a non-default value; see docs/parallel.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.errors import ConfigError, NotSupportedError
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.parallel.cp import DocumentMask, apply_cp, shard_batch, validate_cp_options
from lmforge.parallel.dims import ParallelDims, ParallelMesh, parallelism_options
from lmforge.parallel.ep import apply_ep
from lmforge.parallel.fsdp import apply_fsdp
from lmforge.parallel.pp import Pipeline, refuse_direct_calls, split_for_pipeline, validate_pp_options
from lmforge.parallel.tp import apply_tp

logger = logging.getLogger(__name__)

# Accepted, no effect here (Ascend/HyperParallel performance switches); a warning names each one set.
INERT_FIELDS = {
    "pipeline_parallel_overlap_p2p": "P2P/compute overlap is left to torch.distributed.pipelining",
    "pipeline_parallel_overlap_b_f": "backward/forward overlap is left to torch.distributed.pipelining",
    "pipeline_parallel_enable_dxdw_split": "the dx/dw split (zero-bubble) schedules are not wired to this switch",
    "pipeline_parallel_p2p_transport": "P2P goes through the process group's send/recv",
    "enable_mc2": "MC2 is an Ascend matmul+communication fusion",
    "expert_parallel_async_d2h": "an Ascend host/device copy optimisation",
    "expert_parallel_use_safe_tokens": "an Ascend dispatch safety switch; the all-to-all here is exact",
    "enable_loss_parallel": "under tp the loss is vocabulary-parallel whenever model.loss_chunk_size > 0 (the default) and computed from gathered logits at 0, whatever this key says (same value)",
    "npu_nums_per_device": "only read by the alltoall_deredundancy check",
    "pipeline_parallel_microbatch_size": "overwritten by the number of accumulation steps, as in the original",
}


def warn_inert_fields(opts: dict[str, Any]) -> list[str]:
    """Warn for every accepted-but-inert field set to a non-default value; return their names."""
    from lmforge.parallel.dims import PARALLELISM_DEFAULTS

    named = []
    for key, why in INERT_FIELDS.items():
        if key in opts and opts[key] != PARALLELISM_DEFAULTS[key]:
            named.append(key)
            logger.warning("parallelism.%s=%r has no effect in lmforge: %s.", key, opts[key], why)
    if opts.get("sequence_parallel") is False and opts.get("tensor_parallel", 1) > 1:
        logger.info("sequence parallel is always on with tensor parallel (the spec's behaviour).")
    if opts.get("context_parallel_async") and opts.get("context_parallel", 1) == 1:
        named.append("context_parallel_async")
        logger.warning(
            "parallelism.context_parallel_async: true has no effect with context_parallel 1 (there is no "
            "context-parallel communication to overlap)."
        )
    if opts.get("disable_gradient_division") is False:
        logger.warning(
            "parallelism.disable_gradient_division: false has no numerical effect: lmforge always sums gradients "
            "over data-parallel ranks and divides once, by the global token count, in the loss."
        )
    return named


def validate_options(section: Any, dims: ParallelDims) -> dict[str, Any]:
    """Every value check that needs no process group (also used by ``lmforge check``)."""
    from lmforge.parallel.fsdp import _reshard_after_forward

    opts = parallelism_options(section)
    _reshard_after_forward(opts)
    validate_cp_options(opts, dims.cp, dims.ulysses)
    validate_pp_options(opts, dims.pp)
    if opts["dense_fsdp_shard_size"] is not None:
        raise ConfigError(
            "parallelism.dense_fsdp_shard_size is not supported: the original declares it without documenting it; "
            "use parallelism.data_parallel_shard (HSDP) and parallelism.expert_parallel, and leave it unset."
        )
    return opts


@dataclass
class ParallelInfo:
    """What the trainer needs to know after parallelising."""

    dims: ParallelDims
    mesh: ParallelMesh
    dp_group: Any  # loss / token-count reduction group (data-parallel ranks)
    dp_rank: int
    dp_size: int
    # pp > 1: this rank's stages and their schedule, run explicitly by the train step and evaluation.
    pipeline: Pipeline | None = None
    # Ranks that see the same layers on different tokens/heads (all but pp): QK-Clip's MAX reduction.
    qk_clip_group: Any = None


def _sum_over_cp(x: torch.Tensor, cp_mesh: Any) -> torch.Tensor:
    """The sum of ``x`` over the cp ranks; in backward each rank keeps its own gradient (identity).

    Every cp rank then holds the same loss and backpropagates it through the tokens it computed; the
    gradient reduction over data × context ranks adds those parts. In DTensor terms: each rank's value
    is a ``Partial`` summand, redistributed to ``Replicate`` (the all-reduce); the gradient that comes
    back is declared ``Replicate`` at both ends, so no collective runs in backward.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    summands = DTensor.from_local(x, cp_mesh, (Partial(),), run_check=False, grad_placements=(Replicate(),))
    return summands.redistribute(cp_mesh, (Replicate(),)).to_local(grad_placements=(Replicate(),))


def _install_cp_io(model: nn.Module, cp_mesh: Any, doc_mask: DocumentMask | None) -> None:
    """Shard the batch before the model and sum loss and token counts over cp after it."""
    cp, rank, group = cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group()

    def pre_hook(mod, args, kwargs):
        batch = dict(kwargs)
        if args:
            batch["input_ids"] = args[0]
        return (), shard_batch(batch, cp, rank, doc_mask)

    def post_hook(mod, args, kwargs, out):
        if getattr(out, "loss_sum", None) is None:
            return out
        import torch.distributed as dist

        out.loss_sum = _sum_over_cp(out.loss_sum, cp_mesh)
        n = out.num_tokens.detach().clone()
        dist.all_reduce(n, group=group)
        out.num_tokens = n
        aux = out.aux_loss if getattr(out, "aux_loss", None) is not None else 0.0
        # Balancing losses are per chunk; each of the cp ranks contributes 1/cp of the mean.
        out.aux_loss = aux / cp if isinstance(aux, torch.Tensor) else aux
        out.loss = out.loss_sum / n.clamp(min=1) + out.aux_loss
        return out

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)


def refuse_unsupported(model: nn.Module, dims: ParallelDims) -> None:
    """Combinations of model features and degrees that are not implemented (also run by lmforge check)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if dims.tp > 1 and model_type is not None:
        from lmforge.models.registry import family_for

        if family_for(model_type).tp_plan is None:
            raise NotSupportedError(
                f"parallelism.tensor_parallel > 1: model_type {model_type!r} declares no tensor-parallel plan "
                "(its family's tp_plan); set parallelism.tensor_parallel: 1."
            )
    mtp = getattr(model, "mtp", None) is not None
    if dims.cp > 1 and mtp:
        raise NotSupportedError(
            "parallelism.context_parallel > 1 with multi-token prediction (model mtp_num_layers > 0) is not "
            "supported: MTP shifts tokens across the load-balanced sequence chunks. Set one of them off."
        )
    if dims.pp > 1 and dims.tp > 1 and getattr(model, "output_layer", "missing") is None:
        raise NotSupportedError(
            "parallelism.pipeline_parallel > 1 with tensor_parallel > 1 and tied word embeddings (model "
            "tie_word_embeddings: true) is not supported yet; untie them or drop one of the two degrees."
        )


def _sequence_length_check(dims: ParallelDims) -> Callable[[torch.Tensor], None]:
    """Sequence parallel splits the (context-parallel) sequence over tp: its length must divide."""
    unit = dims.tp * (2 * dims.cp if dims.cp > 1 else 1)

    def check(ids: torch.Tensor) -> None:
        if ids.shape[-1] % unit:
            raise ConfigError(
                f"the sequence length {ids.shape[-1]} must be divisible by {unit} = "
                f"{'2 × parallelism.context_parallel × ' if dims.cp > 1 else ''}parallelism.tensor_parallel "
                "(sequence parallel splits the sequence over the tensor-parallel ranks); change the data's "
                "seq_length or the parallel degrees."
            )

    return check


def _check_sequence_length(model: nn.Module, dims: ParallelDims) -> None:
    check = _sequence_length_check(dims)

    def pre_hook(mod, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None:
            check(ids)

    # Registered first, so it runs before the context-parallel batch sharding.
    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _install_tp_output(model: nn.Module, tp_mesh: Any) -> None:
    """The logits need the whole sequence: the final norms' outputs are gathered over tp (torch's
    ``PrepareModuleOutput``: sequence shard → replicated; the gradient keeps this rank's slice). The output
    weight is a DTensor split by vocabulary rows; the model's loss reads its local rows, or gathers it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    norms = [model.decoder.final_layernorm]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # each MTP depth computes logits from its own final norm
        norms += [depth.final_layernorm for depth in mtp.layers]
    gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    for norm in norms:
        if norm is not None:
            parallelize_module(norm, tp_mesh, gather)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: ParallelMesh,
    section: Any,
    *,
    compute_dtype: torch.dtype | None = None,
    num_microbatches: int = 1,
    apply_activation: Callable[[nn.Module], None] | None = None,
    device: torch.device | None = None,
) -> tuple[nn.Module, ParallelInfo]:
    """Apply every configured parallelism to ``model`` (on meta) in place; return it and the trainer facts."""
    from torch.distributed.tensor import DTensor

    opts = validate_options(section, dims)
    warn_inert_fields(opts)
    compute_dtype = compute_dtype or getattr(model, "compute_dtype", torch.float32)
    device = device or torch.device(mesh.world.device_type)
    cfg = getattr(model, "config", None)
    if isinstance(cfg, TransformerConfig):
        dims.check_transformer(cfg, opts)
    refuse_unsupported(model, dims)
    tied_output = getattr(model, "output_layer", "missing") is None  # before pipeline pruning clears it
    has_mtp = getattr(model, "mtp", None) is not None  # (pruning keeps it on the last stage only)
    stage_specs = None
    if dims.pp > 1:
        pp_mesh = mesh["pp"]
        stage_specs = split_for_pipeline(model, pp_rank=pp_mesh.get_local_rank(), pp=dims.pp, opts=opts)
    # Experts first: their weights become (ep, tp) DTensors, which tensor parallel then leaves alone.
    if dims.ep > 1:
        apply_ep(model, mesh.expert["ep"], opts, tp_mesh=mesh["tp"] if dims.tp > 1 else None)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
        _install_tp_output(model, mesh["tp"])
    if dims.tp > 1 or dims.cp > 1:
        _check_sequence_length(model, dims)
    if dims.cp > 1:
        method = validate_cp_options(opts, dims.cp, dims.ulysses)
        # Document masks: one micro-batch's forward and backward at a time, so not under pipeline parallel.
        doc_mask = DocumentMask() if dims.pp == 1 else None
        apply_cp(model, mesh["cp"], method, split_mesh=mesh.cp_split, doc_mask=doc_mask)
        _install_cp_io(model, mesh["cp"], doc_mask)
    if apply_activation is not None:
        apply_activation(model)
    pipeline = None
    if dims.pp > 1:
        n_stages = dims.pp * opts["pipeline_parallel_interleave_num"]
        pipeline = Pipeline(
            model,
            stage_specs,
            pp_mesh=mesh["pp"],
            cp_mesh=mesh["cp"],  # the pipeline shards each micro-batch over cp itself (no model call)
            n_stages=n_stages,
            schedule=opts["pipeline_parallel_schedule"],
            num_microbatches=num_microbatches,
            device=device,
            compute_dtype=compute_dtype,
            check_batch=_sequence_length_check(dims) if dims.tp > 1 or dims.cp > 1 else None,
            tp_size=dims.tp,
        )
        roots = pipeline.stage_modules
        if tied_output or has_mtp:  # the last stage needs the embedding: see pp_tied
            from lmforge.parallel.pp_tied import LastStageEmbedding, pair_groups

            pp_rank = mesh["pp"].get_local_rank()
            pipeline.attach_last_stage_embedding(
                LastStageEmbedding(
                    model,
                    pair_groups(mesh.world),
                    pp_rank == 0,
                    pp_rank == dims.pp - 1,
                    compute_dtype,
                    tied=tied_output,
                    tp_rank=mesh["tp"].get_local_rank() if dims.tp > 1 else 0,
                    tp_size=dims.tp,
                )
            )
        refuse_direct_calls(model)
    else:
        roots = [model]
    expert_mesh = mesh.expert_fsdp_mesh() if dims.ep > 1 else None
    for root in roots:
        apply_fsdp(
            root,
            mesh.fsdp_mesh(),
            opts,
            compute_dtype=compute_dtype,
            expert_mesh=expert_mesh,
            layers=_layers_of(root, model),
        )
    leftovers = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if leftovers:
        raise RuntimeError(f"parameters left unsharded by parallelize (a bug): {leftovers[:5]}")
    _sum_expert_counts(model, mesh["dp_cp_tp"].get_group())
    info = ParallelInfo(
        dims=dims,
        mesh=mesh,
        dp_group=mesh["dp"].get_group(),
        dp_rank=mesh.dp_rank,
        dp_size=dims.dp,
        pipeline=pipeline,
        qk_clip_group=mesh["dp_cp_tp"].get_group(),
    )
    return model, info


def _sum_expert_counts(model: nn.Module, group: Any) -> None:
    """Aux-loss-free balancing: every replica updates its expert bias from the counts of all ranks.

    Data, context and sequence-parallel ranks route different tokens; without the sum each replica's
    router bias would drift apart. Each MoE layer sums its counts over ``group`` in its own
    ``update_expert_bias`` (the trainer still calls the model's ``update_expert_bias()``).
    """
    from lmforge.models.common.moe import moe_layers

    for moe in moe_layers(model):
        moe.bias_counts_group = group


def _layers_of(root: nn.Module, model: nn.Module) -> list[nn.Module]:
    from lmforge.parallel.fsdp import decoder_layers

    if root is model:
        return decoder_layers(model)
    mtp = list(root.mtp.layers) if getattr(root, "mtp", None) is not None else []  # the last stage's
    return [*root.layers, *mtp]
