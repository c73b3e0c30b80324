"""What ``lmforge check --world-size N`` shows about parallelism: the mesh, each rank's share, memory.

Everything here runs in one process without a process group: the model is built on the meta device,
the degrees are checked against it, and the memory estimate of :mod:`lmforge.parallel.memory` is
printed per rank.
"""

from __future__ import annotations

from typing import Any

from lmforge.config.load import as_section
from lmforge.errors import NotSupportedError
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.memory import describe_ranks, estimate_memory, format_bytes, selected_recompute_parts

MAX_RANK_LINES = 16


def parallel_plan(
    parallelism: Any, model: Any, training: Any, optimizer: Any, world_size: int, recompute: Any = None
) -> list[str]:
    """Lines describing the parallel plan; raises ConfigError for anything that would fail at start-up."""
    import torch

    from lmforge.models import build_model
    from lmforge.parallel.api import refuse_unsupported, validate_options, warn_inert_fields
    from lmforge.parallel.plan import accumulation_steps

    dims = ParallelDims.from_section(parallelism, world_size)
    opts = validate_options(parallelism, dims)
    inert = warn_inert_fields(opts)
    net = build_model(model, device="meta")
    try:
        refuse_unsupported(net, dims)
    except NotSupportedError as exc:
        unsupported = f"  warning: {exc} `lmforge train` will refuse this layout."
    else:
        unsupported = None
    cfg = net.config
    dims.check_transformer(cfg, opts, seq_length=cfg.seq_length)
    train = as_section("training", training)
    lbs = int(train.local_batch_size)
    accum = accumulation_steps(int(train.global_batch_size), lbs, dims.dp)
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
            opts["pipeline_parallel_layers_per_stage"],
            num_layers=cfg.num_layers,
            pp=dims.pp,
            interleave=opts["pipeline_parallel_interleave_num"],
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
    opt = as_section("optimizer", optimizer)
    est = estimate_memory(
        net,
        dims,
        compute_dtype=getattr(net, "compute_dtype", torch.float32),
        optimizer_type=str(opt.type),
        moment_bytes=2 if opt.get("moment_dtype") == "bfloat16" else 4,
        offload_states=bool(opt.get("offload_states", False)),
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
