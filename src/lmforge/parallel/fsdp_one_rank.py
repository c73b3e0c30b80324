"""FSDP2's collectives for a shard group of one rank (one process, or HSDP with a shard dimension of 1).

Nothing is gathered or scattered there, but FSDP2 still moves every byte through its buffers: the
all-gather copies the gathered buffer onto itself (gloo at one rank), and the gradient reduction
copies the fp32 reduce-scatter input into a second buffer of the same size (``reduce_output.copy_``).
At 100M parameters those two passes cost about 6% of a CPU training step (docs/benchmarks.md). Both are
removed through FSDP2's public extension points (``set_custom_all_gather`` /
``set_custom_reduce_scatter``):

* :class:`OneRankAllGather` does nothing: at one rank FSDP2's all-gather input is a view of the whole
  output buffer, so the output already holds the data.
* :class:`OneRankReduceScatter` hands out the reduce-scatter input buffer again as the reduce output, so
  FSDP2's ``reduce_output.copy_(reduce_scatter_input)`` copies a tensor onto itself, which torch skips.
  FSDP2 asks for the input buffer, then for the output buffer, once per reduction; a buffer handed out
  as input is returned as the output on the next request unless one of the group's gradients already
  lives in it (then that request was itself an input: a reduction interrupted by an exception left the
  pairing out of step, and it re-synchronises instead of overwriting a gradient).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _comm_bases() -> tuple[type, type]:
    # The base classes set_custom_all_gather/set_custom_reduce_scatter take; torch 2.13 does not re-export
    # them from torch.distributed.fsdp, so they come from the module that defines them.
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def make_one_rank_comms(params: list[nn.Parameter]) -> tuple[Any, Any]:
    """An (all-gather, reduce-scatter) pair for one FSDP module whose group owns ``params``."""
    all_gather_base, reduce_scatter_base = _comm_bases()

    class OneRankAllGather(all_gather_base):
        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            if group.size() != 1:
                raise RuntimeError("OneRankAllGather is only valid for a shard group of one rank.")
            # The input is output_tensor.narrow(0, 0, numel) with numel == output numel: nothing to move.
            return None

    class OneRankReduceScatter(reduce_scatter_base):
        def __init__(self) -> None:
            self._pending: torch.Tensor | None = None

        def _holds_a_gradient(self, buffer: torch.Tensor) -> bool:
            ptr = buffer.untyped_storage().data_ptr()
            for p in params:
                if p.grad is not None and _local(p.grad).untyped_storage().data_ptr() == ptr:
                    return True
            return False

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            pending, self._pending = self._pending, None
            numel = math.prod(int(s) for s in size)
            if (
                pending is not None
                and pending.numel() == numel
                and pending.dtype == dtype
                and pending.device == device
                and not self._holds_a_gradient(pending)
            ):
                return pending.view(*size)  # the reduce output: the input itself
            buffer = torch.empty(*size, dtype=dtype, device=device)
            self._pending = buffer
            return buffer

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            # FSDP2 copies instead of calling the collective when its shard group has one rank.
            raise RuntimeError("OneRankReduceScatter is only valid for a shard group of one rank.")

    return OneRankAllGather(), OneRankReduceScatter()


def use_one_rank_comms(modules: list[nn.Module]) -> None:
    """Install the one-rank collectives on each of ``modules`` (FSDP modules whose shard group has one
    rank); each gets its own pair, holding the parameters its group manages."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        inner = {
            id(p)
            for sub in module.modules()
            if sub is not module and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        own = [p for p in module.parameters() if id(p) not in inner]
        all_gather, reduce_scatter = make_one_rank_comms(own)
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
