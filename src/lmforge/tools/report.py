"""What ``lmforge check --world-size N`` shows about parallelism: the mesh, each rank's share, memory.

Everything here runs in one process without a process group: the model is built on the meta device,
the degrees are checked against it, and the memory estimate of :mod:`lmforge.tools.memory` is
printed per rank.
"""

from __future__ import annotations

from lmforge.config.sections_components import ModelConfig, OptimizerConfig
from lmforge.config.sections_parallel import ParallelismConfig, RecomputeConfig
from lmforge.config.sections_run import TrainingConfig
from lmforge.errors import ConfigError, NotSupportedError
from lmforge.parallel.dims import ParallelDims
from lmforge.tools.memory import describe_ranks, estimate_memory, format_bytes, selected_recompute_parts

MAX_RANK_LINES = 16


def parallel_plan(
    parallelism: ParallelismConfig,
    model: ModelConfig,
    training: TrainingConfig,
    optimizer: OptimizerConfig,
    world_size: int,
    recompute: RecomputeConfig | None = None,
) -> list[str]:
    """Lines describing the parallel plan of the typed sections (``model``: the validated model section);
    raises ConfigError for anything that would fail at start-up."""
    import torch

    from lmforge.config.inert import inert_keys
    from lmforge.models import build_model
    from lmforge.parallel.api import refuse_unsupported
    from lmforge.parallel.plan import BatchSchedule

    dims = ParallelDims.from_section(parallelism, world_size)
    inert = inert_keys("parallelism", parallelism)
    net = build_model(model, device="meta")
    try:
        refuse_unsupported(net, dims)
    except NotSupportedError as exc:
        unsupported = f"  warning: {exc} `lmforge train` will refuse this layout."
    else:
        unsupported = None
    cfg = net.config
    dims.check_transformer(cfg, parallelism, seq_length=cfg.seq_length)
    lbs = int(training.local_batch_size)
    batches = BatchSchedule.of(training, dims.dp)
    if batches.problems():
        raise ConfigError(batches.problems()[0])
    accum = batches.accumulation_steps_at(0)
    lines = [
        f"Parallel mesh (world size {world_size}): pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard "
        f"{dims.dp_shard} x cp {dims.cp} x tp {dims.tp}"
        + (f"; expert parallel {dims.ep}" if dims.ep > 1 else ""),
        f"  FSDP shards each parameter over {dims.fsdp_size} rank(s)"
        + (f", replicated {dims.dp_replicate}x (HSDP)" if dims.dp_replicate > 1 else "")
        + (
            f"; experts over {dims.ep} rank(s), their FSDP over {dims.expert_fsdp_size}"
            if dims.ep > 1
            else ""
        ),
        f"  micro-batches per step (= pipeline micro-batches): {accum}",
    ]
    if dims.pp > 1:
        from lmforge.parallel.pp_layout import stage_layers

        stages = stage_layers(
            parallelism.pipeline_parallel_layers_per_stage,
            num_layers=cfg.num_layers,
            pp=dims.pp,
            interleave=parallelism.pipeline_parallel_interleave_num,
        )
        for s, layers in enumerate(stages):
            lines.append(f"  pipeline stage {s} (pp rank {s % dims.pp}): layers {layers[0]}-{layers[-1]}")
        if cfg.mtp_num_layers:  # the MTP layers go with the last stage (parallel/pp.py)
            first, last = cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers - 1
            lines[-1] += f", MTP layer {first}" if first == last else f", MTP layers {first}-{last}"
    ranks = describe_ranks(dims)
    lines += ["  " + r for r in ranks[:MAX_RANK_LINES]]
    if len(ranks) > MAX_RANK_LINES:
        lines.append(f"  ... ({len(ranks) - MAX_RANK_LINES} more ranks)")
    opt = optimizer.typed  # lmforge.optim.OptimizerOptions
    est = estimate_memory(
        net,
        dims,
        compute_dtype=getattr(net, "compute_dtype", torch.float32),
        optimizer_type=str(opt.type),
        moment_bytes=2 if opt.hyper.moment_dtype == "bfloat16" else 4,
        offload_states=opt.hyper.offload_states,
        seq_length=cfg.seq_length,
        local_batch_size=lbs,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        accumulation_steps=accum,
        recompute_select=selected_recompute_parts(net, recompute, cfg.num_layers),
    )
    lines.append(
        f"Per-rank memory estimate (most loaded rank, {est.local_parameter_count:,} parameters held):"
    )
    lines += [f"  {name}: {format_bytes(value)}" for name, value in est.rows()]
    lines += [f"  note: {n}" for n in est.notes]
    if inert:
        lines.append("  accepted without effect: " + ", ".join(f"parallelism.{k}" for k in inert))
    if unsupported:
        lines.append(unsupported)
    return lines
