"""Layout-invariant initialisation: one seed gives the same initial weights on every parallel layout.

The value of every element of a parameter depends only on the seed, the parameter's name and the
element's global index — never on how the parameter is split over ranks. A matrix is cut into blocks
of whole rows (dim 0) whose size depends only on the global shape; block ``b`` is drawn from its own
generator, seeded by a hash of ``(seed, name, b)``. A rank that holds a shard of the parameter (a
``DTensor`` of FSDP, TP, EP, HSDP or their combinations) finds the global indices of its elements
along each dimension and draws only the row blocks that contain its rows: at most one block of the
full tensor exists at a time, never the whole tensor.

torch's own ``normal_`` on a DTensor draws each shard from the rank's local generator on CPU, so the
weights of a 2-rank run differ from those of a 1-rank run with the same seed; this module is why they
do not here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

# About this many elements per drawn block: large enough that the per-block generator set-up is
# negligible, small enough that a block is a small fraction of any large matrix.
_BLOCK_ELEMENTS = 1 << 18

# Wrapper segments that torch's composable APIs insert into parameter names (activation checkpointing,
# torch.compile): the canonical name of a parameter does not depend on them.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """The parameter's name without the segments that wrappers insert."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit generator seed for row block ``block`` of parameter ``name`` (stable across runs)."""
    digest = hashlib.blake2b(f"{int(seed)}\0{canonical_name(name)}\0{block}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def rows_per_block(shape: Sequence[int]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, _BLOCK_ELEMENTS // max(row, 1))


def _global_indices(param: torch.Tensor) -> list[torch.Tensor] | None:
    """For a DTensor, the global index of each local position along every dimension (None: a plain
    tensor, which holds every index)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    if not isinstance(param, DTensor):
        return None
    shape = param.shape
    out = []
    for d in range(len(shape)):
        view = [1] * len(shape)
        view[d] = shape[d]
        index = torch.arange(shape[d], dtype=torch.int64).view(view)
        # Only the placements that split dimension d move its indices; the other dims have size 1 here.
        # (FSDP over a TP-sharded dimension uses _StridedShard, which is not a Shard subclass: test .dim.)
        placements = [p if getattr(p, "dim", None) == d else Replicate() for p in param.placements]
        local = distribute_tensor(index, param.device_mesh, placements, src_data_rank=None).to_local()
        out.append(local.reshape(-1))
    return out


def _as_range(index: torch.Tensor) -> tuple[int, int] | None:
    """``(start, stop)`` when ``index`` is a contiguous ascending run (every common shard is)."""
    if index.numel() == 0:
        return None
    start, stop = int(index[0]), int(index[-1]) + 1
    if stop - start == index.numel() and torch.equal(index, torch.arange(start, stop)):
        return start, stop
    return None


@torch.no_grad()
def normal_(
    param: torch.Tensor, name: str, seed: int, std: float, order: tuple[int, torch.Tensor] | None = None
) -> None:
    """Fill ``param`` (a tensor or a DTensor shard) with N(0, std²), layout-invariantly.

    ``order`` = ``(dim, rows)``: the stored index ``i`` along ``dim`` holds the drawn index ``rows[i]`` (a
    fused weight stored in another row order than the one it is drawn in, ``models/common/fused_layout.py``:
    the same seed then gives the same function whatever the storage layout)."""
    shape = tuple(param.shape)
    local = param.to_local() if hasattr(param, "to_local") else param
    if local.numel() == 0:
        return
    if not shape:
        g = torch.Generator().manual_seed(block_seed(seed, name, 0))
        local.copy_(torch.randn((), generator=g) * std)
        return
    indices = _global_indices(param) or [torch.arange(n, dtype=torch.int64) for n in shape]
    if order is not None:
        dim, drawn = order
        indices[dim] = drawn.to(torch.int64).index_select(0, indices[dim])
    # Other dimensions: a contiguous range is a slice (the common case), anything else a gather.
    other: list[tuple[int, int] | torch.Tensor] = []
    for d in range(1, len(shape)):
        span = _as_range(indices[d])
        other.append(indices[d] if span is None else span)
    rows = indices[0]
    per_block = rows_per_block(shape)
    row_span = _as_range(rows)
    blocks = range(row_span[0] // per_block, (row_span[1] - 1) // per_block + 1) if row_span else None
    for b in blocks if blocks is not None else torch.unique(rows // per_block).tolist():
        first = b * per_block
        count = min(per_block, shape[0] - first)
        g = torch.Generator().manual_seed(block_seed(seed, name, b))
        whole_rows = all(isinstance(sel, tuple) and sel == (0, n) for sel, n in zip(other, shape[1:]))
        if row_span is not None and whole_rows and local.dtype == torch.float32 and local.is_contiguous():
            lo, hi = max(first, row_span[0]), min(first + count, row_span[1])
            if (lo, hi) == (first, first + count) and local.device.type == "cpu":
                # The shard holds the whole block: draw it in place (the same values as drawn aside).
                local[lo - row_span[0] : hi - row_span[0]].normal_(0.0, std, generator=g)
                continue
        values = torch.empty((count, *shape[1:]), dtype=torch.float32).normal_(0.0, std, generator=g)
        if row_span is not None:  # the rows of this block that the shard holds, as slices
            lo, hi = max(first, row_span[0]), min(first + count, row_span[1])
            values, target = values[lo - first : hi - first], slice(lo - row_span[0], hi - row_span[0])
        else:
            where = ((rows // per_block) == b).nonzero().reshape(-1)
            values, target = values.index_select(0, rows.index_select(0, where) - first), where
        for d, sel in enumerate(other, start=1):
            values = (
                values.narrow(d, sel[0], sel[1] - sel[0])
                if isinstance(sel, tuple)
                else values.index_select(d, sel)
            )
        if isinstance(target, slice):
            local[target].copy_(values)
        else:
            local.index_copy_(0, target.to(local.device), values.to(device=local.device, dtype=local.dtype))


def draw_seed() -> int:
    """A seed for ``init_weights`` drawn from torch's global generator (so ``torch.manual_seed`` keeps
    controlling initialisation when no seed is given explicitly)."""
    return int(torch.randint(0, 2**62, (1,)).item())
