"""Where Muon's Newton-Schulz runs when weights are sharded (FSDP2 DTensors).

Newton-Schulz must see the whole, fully reduced matrix: it never runs on a local shard of a 2-D
weight. Two strategies (the ``comm_strategy`` field):

* ``allgather``: every rank all-gathers each sharded matrix (in the NS dtype), orthogonalises all of
  them, and keeps its own rows of the update. Simple; the NS work is repeated on every rank.
* ``allgather_deredundency``: each sharded matrix gets an owner rank (greedy: heaviest first, to the
  least-loaded rank, ties to the lowest rank); its shards are gathered on the owner only, the owner
  orthogonalises everything it owns in one batch, and scatters each rank its rows of the update.

A 3-D expert stack sharded along the expert dimension holds whole matrices on each rank, so its
experts are orthogonalised locally under both strategies. Both strategies give the single-process
update: the same full matrices go through the same Newton-Schulz.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lmforge.optim.newton_schulz import Schedule, orthogonalize_many
from lmforge.utils.muon_split import MuonSplit, join_pieces, split_pieces


@dataclass
class MuonWork:
    """One Muon parameter's step input: ``u`` (the Nesterov sum in the Newton-Schulz dtype, local shard
    if sharded) and how to treat it."""

    u: torch.Tensor
    layout: DTensor | None  # the master when sharded: mesh, placements and global shape
    split: MuonSplit | None  # from the model's split schema
    lr_rms: float  # lr * matched_adamw_rms; each piece also gets sqrt(max(A, B))


def _pieces(u: torch.Tensor, split: MuonSplit | None) -> list[torch.Tensor]:
    return [u] if split is None else split_pieces(u, split)


def scaled_updates(
    fulls: list[torch.Tensor], works: list[MuonWork], schedule: Schedule, eps: float, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``lr * rms * sqrt(max(A, B)) * NS(piece)`` for every piece of every full matrix, re-assembled (fp32)."""
    pieces: list[torch.Tensor] = []
    counts = []
    for u, w in zip(fulls, works):
        ps = _pieces(u, w.split)
        pieces.extend(ps)
        counts.append(len(ps))
    ortho = orthogonalize_many(pieces, schedule, eps, dtype)
    out = []
    k = 0
    for n, w in zip(counts, works):
        scaled = [
            ortho[k + j].float().mul_(w.lr_rms * math.sqrt(max(o.shape[-2], o.shape[-1])))
            for j, o in enumerate(ortho[k : k + n])
        ]
        k += n
        out.append(scaled[0] if w.split is None else join_pieces(scaled, w.split))
    return out


def whole_matrices_local(w: MuonWork) -> bool:
    """True when each local shard holds whole matrices (3-D stack sharded on the expert dim only)."""
    if w.layout is None:
        return True
    if w.u.dim() < 3:
        return False
    split_dim = w.split[0] % w.u.dim() if w.split is not None else None
    return split_dim != 0 and all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in w.layout.placements
    )


def _single_shard_dim(w: MuonWork) -> int | None:
    """The sharded dim when ``w`` lives on a 1-D mesh with one ``Shard`` placement, else None."""
    lay = w.layout
    if lay is None or lay.device_mesh.ndim != 1 or not isinstance(lay.placements[0], Shard):
        return None
    return lay.placements[0].dim % lay.dim()


def _to_local_rows(full: torch.Tensor, layout: DTensor) -> torch.Tensor:
    # Every rank holds the full update, so slicing needs no communication.
    return distribute_tensor(full, layout.device_mesh, layout.placements, src_data_rank=None).to_local()


def ns_cost(w: MuonWork, ns_steps: int) -> float:
    """Estimated Newton-Schulz work of one parameter (the original's estimate)."""
    shape = w.layout.shape if w.layout is not None else w.u.shape
    total = 0.0
    for piece_shape in _piece_shapes(shape, w.split):
        a, b = piece_shape[-2], piece_shape[-1]
        s, big = min(a, b), max(a, b)
        batch = math.prod(piece_shape[:-2]) if len(piece_shape) > 2 else 1
        total += batch * (ns_steps * (2 * big * s * s + s**3) + a * b)
    return total


def _piece_shapes(shape: torch.Size, split: MuonSplit | None) -> list[list[int]]:
    if split is None:
        return [list(shape)]
    dim, sizes = split.dim, split.sizes
    out = []
    for s in sizes:
        ps = list(shape)
        ps[dim] = s
        out.append(ps)
    return out


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Greedy: heaviest first, each to the least-loaded rank (ties: lowest rank)."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def compute_updates(
    works: list[MuonWork], strategy: str, schedule: Schedule, eps: float, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The scaled Muon update of every parameter, in its local (shard) layout, fp32."""
    local_idx = [i for i, w in enumerate(works) if whole_matrices_local(w)]
    sharded_idx = [i for i, w in enumerate(works) if not whole_matrices_local(w)]
    p2p = strategy == "allgather_deredundency" and all(
        _single_shard_dim(works[i]) is not None for i in sharded_idx
    )
    if not p2p:
        return _allgather_updates(works, local_idx, sharded_idx, schedule, eps, dtype)
    return _owner_updates(works, local_idx, sharded_idx, schedule, eps, dtype)


def _allgather_updates(works, local_idx, sharded_idx, schedule, eps, dtype) -> list[torch.Tensor]:
    fulls: dict[int, torch.Tensor] = {i: works[i].u for i in local_idx}
    for i in sharded_idx:
        lay = works[i].layout
        dt = DTensor.from_local(
            works[i].u.to(dtype),
            lay.device_mesh,
            lay.placements,
            run_check=False,
            shape=lay.shape,
            stride=lay.stride(),
        )
        fulls[i] = dt.full_tensor()
    order = local_idx + sharded_idx
    ups = scaled_updates([fulls[i] for i in order], [works[i] for i in order], schedule, eps, dtype)
    result: list[torch.Tensor | None] = [None] * len(works)
    for i, up in zip(order, ups):
        result[i] = up if i in local_idx else _to_local_rows(up, works[i].layout)
    return result  # type: ignore[return-value]


def _chunk_bounds(n: int, world: int) -> list[tuple[int, int]]:
    # DTensor's Shard follows torch.chunk: ceil-sized chunks, possibly empty at the end.
    chunk = -(-n // world)
    return [(min(r * chunk, n), max(0, min(chunk, n - r * chunk))) for r in range(world)]


def _pad_along(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim).contiguous()


def _owner_updates(works, local_idx, sharded_idx, schedule, eps, dtype) -> list[torch.Tensor]:
    ns_steps = len(schedule)
    result: list[torch.Tensor | None] = [None] * len(works)
    if not sharded_idx:
        ups = scaled_updates(
            [works[i].u for i in local_idx], [works[i] for i in local_idx], schedule, eps, dtype
        )
        return ups
    mesh = works[sharded_idx[0]].layout.device_mesh
    group = mesh.get_group()
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    owners = dict(zip(sharded_idx, assign_owners([ns_cost(works[i], ns_steps) for i in sharded_idx], world)))

    # Phase 1: gather each sharded matrix on its owner (async, buffers kept alive until wait()).
    pending = []
    for i in sharded_idx:
        w = works[i]
        d = _single_shard_dim(w)
        n = w.layout.shape[d]
        chunk = -(-n // world)
        send = _pad_along(w.u.to(dtype), d, chunk)
        recv = [torch.empty_like(send) for _ in range(world)] if owners[i] == me else None
        handle = dist.gather(
            send, recv, dst=dist.get_global_rank(group, owners[i]), group=group, async_op=True
        )
        pending.append((i, d, n, send, recv, handle))
    fulls: dict[int, torch.Tensor] = {}
    for i, d, n, _send, recv, handle in pending:
        handle.wait()
        if recv is not None:
            fulls[i] = torch.cat(recv, dim=d).narrow(d, 0, n)

    # Phase 2: Newton-Schulz of everything this rank owns (plus its local expert stacks), batched.
    order = local_idx + [i for i in sharded_idx if owners[i] == me]
    ups = scaled_updates(
        [works[i].u if i in local_idx else fulls[i] for i in order],
        [works[i] for i in order],
        schedule,
        eps,
        dtype,
    )
    full_updates = dict(zip(order, ups))
    for i in local_idx:
        result[i] = full_updates[i]

    # Phase 3: each owner scatters the rows of the update back to their ranks.
    pending = []
    for i in sharded_idx:
        w = works[i]
        d = _single_shard_dim(w)
        n = w.layout.shape[d]
        bounds = _chunk_bounds(n, world)
        chunk = -(-n // world)
        shape = list(w.layout.shape)
        shape[d] = chunk
        recv = torch.empty(shape, dtype=torch.float32, device=w.u.device)
        send = None
        if owners[i] == me:
            up = full_updates[i]
            send = [_pad_along(up.narrow(d, start, size), d, chunk) for start, size in bounds]
        handle = dist.scatter(
            recv, send, src=dist.get_global_rank(group, owners[i]), group=group, async_op=True
        )
        pending.append((i, d, bounds[me][1], recv, send, handle))
    for i, d, size, recv, _send, handle in pending:
        handle.wait()
        result[i] = recv.narrow(d, 0, size)
    return result  # type: ignore[return-value]
