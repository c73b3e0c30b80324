"""The single seam between the trainer and parallelism.

``distributed_env()`` reads the torchrun environment; ``ParallelContext`` tells the loop its data
parallel rank/size and how gradients are reduced; ``parallelize(model, ctx, cfg)`` is where
``lmforge.parallel`` (FSDP2 / TP / PP / CP / EP) plugs in. Until then, plain data parallelism is
done here: replicas all-reduce (sum) their gradients after the backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.utils.elastic import DEFAULT_TIMEOUT_S, init_process_group


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device = torch.device("cpu")
    # True when a wrapper (FSDP/DDP) already reduces gradients across data-parallel ranks; then
    # ``grad_reduce_is_mean`` says whether it averages (the step scales its objective to match).
    wrapper_reduces_grads: bool = False
    grad_reduce_is_mean: bool = True
    dp_group: Any = None
    # pp > 1: the ``lmforge.parallel.pp.Pipeline`` whose schedule the step and evaluation run.
    pipeline: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def distributed_env(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Initialise torch.distributed from torchrun's environment (if launched that way).

    ``timeout_s`` is ``parallelism.process_group_timeout``: how long a collective (and start-up) may
    wait for the slowest rank before the job fails (and torchrun may restart it).
    """
    from lmforge.utils.device import env_int, run_device_type

    world = env_int("WORLD_SIZE", 1, minimum=1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    if rank >= world:
        from lmforge.errors import ConfigError

        raise ConfigError(f"The environment variable RANK={rank} must be below WORLD_SIZE={world}.")
    use_cuda = run_device_type(device) == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        init_process_group("nccl" if use_cuda else "gloo", rank, world, timeout_s)
    return ParallelContext(
        rank=rank, world_size=world, local_rank=local_rank, dp_rank=rank, dp_size=world, device=dev
    )


def parallelize(model: nn.Module, ctx: ParallelContext, cfg: Any = None) -> nn.Module:
    """Apply the configured parallelism to ``model`` (identity until lmforge.parallel lands)."""
    return model


def sync_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    """Sum gradients over data-parallel replicas when no wrapper does it (plain data parallelism)."""
    if ctx.dp_size <= 1 or ctx.wrapper_reduces_grads:
        return
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            dist.all_reduce(g, group=ctx.dp_group)
