"""Differentiable collectives for the hand-written tensor/sequence/context/expert parallel paths.

Each function is a pair of collectives that are each other's adjoint, so the gradients are exact:
all-gather ↔ reduce-scatter (sum), identity ↔ all-reduce (sum), all-to-all ↔ reverse all-to-all.
They work on plain local tensors with a ``ProcessGroup`` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # gloo has no reduce_scatter for uneven chunks; an all-reduce and a slice is exact and simple.
    x = x.contiguous()
    if x.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter a dimension of size {x.shape[dim]} over {world} ranks")
    if dist.get_backend(group) == "nccl":
        moved = x.movedim(dim, 0).contiguous()
        out_moved = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out_moved, moved, group=group)
        return out_moved.movedim(0, dim).contiguous()
    dist.all_reduce(x, group=group)
    return x.chunk(world, dim=dim)[rank].contiguous()


class _GatherFwdReduceScatterBwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad.clone(), ctx.dim, ctx.group), None, None


class _ReduceScatterFwdGatherBwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x.clone(), dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFwdSliceBwd(torch.autograd.Function):
    """All-gather of a tensor whose consumers are replicated: the gradient is the local slice."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=ctx.dim)[rank].contiguous(), None, None


class _IdentityFwdAllReduceBwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllToAll(torch.autograd.Function):
    """Split ``scatter_dim`` into world chunks, send chunk j to rank j, concatenate received on ``gather_dim``."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    inputs = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAllSingle(torch.autograd.Function):
    """Uneven all-to-all along dim 0 (expert dispatch): ``out_splits[j]`` rows come from rank j."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def gather_with_partial_grad(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather; each rank's gradient is a partial sum, so backward reduce-scatters."""
    return _GatherFwdReduceScatterBwd.apply(x, dim, group)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum the ranks' partial tensors and keep this rank's chunk; backward all-gathers."""
    return _ReduceScatterFwdGatherBwd.apply(x, dim, group)


def gather_replicated(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather feeding identical computation on every rank; backward keeps the local slice."""
    return _GatherFwdSliceBwd.apply(x, dim, group)


def all_reduce_grad(x: torch.Tensor, group) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group`` (a replicated weight used on sharded data)."""
    return _IdentityFwdAllReduceBwd.apply(x, group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_to_all_single(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAllSingle.apply(x, out_splits, in_splits, group)
