"""Quantities derived from a configuration and a world size (shown by ``lmforge check``).

The rules are the original trainer's (reference/mindformers.md §4.1, spec 000 §3.1):
``dp = world_size // (tp * pp * cp)`` (expert parallel does not reduce it), the accumulation steps are
``global_batch_size // (dp * local_batch_size)`` with an error when ``dp * lbs > gbs`` and floor
division otherwise, and warm-up steps come from ``warmup_ratio`` (which beats ``warmup_steps``) as
``int(total_steps * ratio)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError


@dataclass(frozen=True)
class DerivedQuantities:
    world_size: int
    data_parallel: int
    data_parallel_replicate: int
    data_parallel_shard: int
    micro_batch_tokens: int | None
    accumulation_steps: int
    effective_global_batch_size: int
    warmup_steps: int | None
    total_steps: int
    warnings: list[str] = field(default_factory=list)


def _warmup_steps(lr: Any, total_steps: int) -> int | None:
    ratio = getattr(lr, "warmup_ratio", None)
    steps = getattr(lr, "warmup_steps", None)
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise ConfigError(f"lr_scheduler.warmup_ratio must be a number in [0, 1], got {ratio!r}")
        if not 0 <= ratio <= 1:
            raise ConfigError(
                f"lr_scheduler.warmup_ratio must be in [0, 1] (the warmup_ratio's value range must be in "
                f"[0,1]), got {ratio}"
            )
        return int(total_steps * ratio)
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ConfigError(f"lr_scheduler.warmup_steps must be an integer >= 0, got {steps!r}")
    if steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {steps}")
    return steps


def derive(cfg: Any, world_size: int = 1) -> DerivedQuantities:
    """Derived quantities of a ``TrainConfig`` for ``world_size`` processes (ConfigError when impossible)."""
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    par, training = cfg.parallelism, cfg.training
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    model_parallel = tp * pp * cp
    dp = world_size // model_parallel
    if dp <= 0:
        raise ConfigError(
            f"parallelism: tensor_parallel({tp}) * pipeline_parallel({pp}) * context_parallel({cp}) must be "
            f"less than or equal to world_size({world_size})."
        )
    warnings: list[str] = []
    if world_size % model_parallel != 0:
        warnings.append(
            f"world size {world_size} is not a multiple of tensor_parallel * pipeline_parallel * "
            f"context_parallel = {model_parallel}; {world_size - dp * model_parallel} process(es) would idle"
        )
    if par.data_parallel_shard < 0:
        replicate, shard = 1, dp
    else:
        replicate = max(dp // par.data_parallel_shard, 1)
        shard = dp // replicate
    lbs, gbs = training.local_batch_size, training.global_batch_size
    per_step = dp * lbs
    if training.rampup_batch_size is None and per_step > gbs:
        raise ConfigError(
            "training.global_batch_size: The product of data_parallel and local_batch_size exceeds "
            f"global_batch_size, please increase global_batch_size or decrease local_batch_size "
            f"(data_parallel {dp} x local_batch_size {lbs} = {per_step} > global_batch_size {gbs})."
        )
    accumulation = max(gbs // per_step, 1) if per_step <= gbs else 1
    effective = accumulation * per_step
    if effective != gbs:
        warnings.append(
            f"training.global_batch_size {gbs} is not a multiple of data_parallel x local_batch_size = "
            f"{per_step}: {accumulation} accumulation step(s), so the effective global batch is {effective} "
            "samples per step"
        )
    if training.rampup_batch_size is not None:
        start, inc, _ = training.rampup_batch_size
        for g in range(start, gbs + 1, inc):
            if g % per_step != 0:
                raise ConfigError(
                    f"training.rampup_batch_size: the global batch size {g} during ramp-up is not a multiple "
                    f"of data_parallel x local_batch_size = {per_step}."
                )
    seq = getattr(cfg.model, "seq_length", None)
    tokens = lbs * seq if isinstance(seq, int) and not isinstance(seq, bool) else None
    return DerivedQuantities(
        world_size=world_size,
        data_parallel=dp,
        data_parallel_replicate=replicate,
        data_parallel_shard=shard,
        micro_batch_tokens=tokens,
        accumulation_steps=accumulation,
        effective_global_batch_size=effective,
        warmup_steps=_warmup_steps(cfg.lr_scheduler, training.steps),
        total_steps=training.steps,
        warnings=warnings,
    )
