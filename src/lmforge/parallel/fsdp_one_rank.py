"""FSDP2's gradient reduction for a shard group of one rank (one process, or HSDP with a shard dimension of 1).

Nothing is scattered there, but FSDP2 (torch 2.13) still copies the fp32 reduce-scatter input into a
second buffer of the same size (``reduce_output.copy_(reduce_scatter_input)``), a pass over every
gradient each step. :class:`OneRankReduceScatter`, installed through FSDP2's public extension point
(``set_custom_reduce_scatter``), hands out the reduce-scatter input buffer again as the reduce output,
so that copy is of a tensor onto itself, which torch skips. FSDP2 asks for the input buffer, then for
the output buffer, once per reduction; a buffer handed out as input is returned as the output on the
next request unless one of the group's gradients already lives in it (then that request was itself an
input: a reduction interrupted by an exception left the pairing out of step, and it re-synchronises
instead of overwriting a gradient).

The all-gather needs nothing of the kind: at a group of one FSDP2 calls no all-gather at all and casts
each parameter straight into its compute copy (so no custom all-gather is installed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _reduce_scatter_base() -> type:
    # The base class set_custom_reduce_scatter takes; torch 2.13 does not re-export it from
    # torch.distributed.fsdp, so it comes from the module that defines it.
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def make_one_rank_reduce_scatter(params: list[nn.Parameter]) -> Any:
    """The reduce-scatter of one FSDP module whose group owns ``params``."""
    reduce_scatter_base = _reduce_scatter_base()

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

    return OneRankReduceScatter()


def use_one_rank_comms(modules: list[nn.Module]) -> None:
    """Install the one-rank reduction on each of ``modules`` (FSDP modules whose shard group has one
    rank); each gets its own, holding the parameters its group manages."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        inner = {
            id(p)
            for sub in module.modules()
            if sub is not module and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        own = [p for p in module.parameters() if id(p) not in inner]
        module.set_custom_reduce_scatter(make_one_rank_reduce_scatter(own))
