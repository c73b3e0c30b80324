"""The single seam between the trainer and parallelism.

``distributed_env()`` sets up the process group (from torchrun's environment, or a one-process group
when the run was started without torchrun: every run takes the same build path, FSDP2 included, see
``lmforge.train.builder``); ``ParallelContext`` tells the loop its data-parallel rank/size and group.
Gradients are always reduced by FSDP2 (a sum, in fp32); the step divides once, by the global token count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lmforge.utils.elastic import DEFAULT_TIMEOUT_S, init_process_group


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device = torch.device("cpu")
    dp_group: Any = None
    # pp > 1: the ``lmforge.parallel.pp.Pipeline`` whose schedule the step and evaluation run.
    pipeline: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def placed(self, info: Any) -> ParallelContext:
        """This context once ``parallelize`` has placed the model (its ``ParallelInfo``): the data-parallel
        rank, size and group the step reduces over, and the pipeline whose schedule it runs."""
        return replace(
            self, dp_rank=info.dp_rank, dp_size=info.dp_size, dp_group=info.dp_group, pipeline=info.pipeline
        )


def init_one_process_group(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A process group of one rank on an in-memory store (no port, no environment variables), so that
    a run started without torchrun builds its device mesh and FSDP2 like any other. Reused when one exists."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks exists, expected one")
        return
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
    )


def distributed_env(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Initialise torch.distributed from torchrun's environment, or as one process without it.

    ``timeout_s`` is ``parallelism.process_group_timeout``: how long a collective (and start-up) may
    wait for the slowest rank before the job fails (and torchrun may restart it).
    """
    from lmforge.utils.device import run_device_type
    from lmforge.utils.elastic import launch_env

    launch = launch_env()
    world, rank, local_rank = launch.world_size, launch.rank, launch.local_rank
    use_cuda = run_device_type(device) == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if world > 1 and not dist.is_initialized():
        init_process_group(backend, rank, world, timeout_s)
    elif world == 1:
        init_one_process_group(backend, timeout_s)
    return ParallelContext(
        rank=rank, world_size=world, local_rank=local_rank, dp_rank=rank, dp_size=world, device=dev
    )
