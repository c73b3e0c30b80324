"""Two gloo ranks, FSDP2-sharded (DTensor Shard(0)) weights: both comm strategies give the
single-process Muon update, and QK-Clip reduces max logits across ranks."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lmforge.config import validate_section
from lmforge.optim import build_optimizer

from .optim_helpers import MLAModel

WORLD = 2
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class Sharded(nn.Module):
    """2-D weights with even and uneven row counts, a fused weight with a split schema, an expert
    stack, and AdamW-branch parameters."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.square = nn.Parameter(torch.randn(6, 6, generator=g))
        self.wide = nn.Parameter(torch.randn(4, 12, generator=g))
        self.uneven = nn.Parameter(torch.randn(7, 12, generator=g))  # 4 + 3 rows
        self.tall = nn.Parameter(torch.randn(12, 4, generator=g))  # same shape as `wide` once transposed
        self.linear_qkv = nn.Parameter(torch.randn(12, 6, generator=g))
        self.experts = nn.Parameter(torch.randn(4, 6, 8, generator=g))
        self.word_embeddings = nn.Parameter(torch.randn(9, 6, generator=g))
        self.norm = nn.Parameter(torch.ones(6))

    def muon_split_schema(self):
        return {"linear_qkv": (0, [6, 3, 3])}


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _run_single(ns_dtype: str, steps: int) -> dict[str, torch.Tensor]:
    model = Sharded()
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Muon", "ns_dtype": ns_dtype, "qk_clip_enabled": False}),
        model,
        0.02,
    )
    for s in range(steps):
        for n, p in model.named_parameters():
            p.grad = _grads(model, s)[n]
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run_sharded(strategy: str, ns_dtype: str, steps: int, mesh) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    model = Sharded()
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    section = {"type": "Muon", "ns_dtype": ns_dtype, "qk_clip_enabled": False, "comm_strategy": strategy}
    opt = build_optimizer(validate_section("optimizer", section), model, 0.02)
    for s in range(steps):
        grads = _grads(model, s)
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(grads[n], mesh, p.placements, src_data_rank=None)
        opt.step()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _check_qk_clip_reduces_across_ranks(rank: int) -> None:
    model = MLAModel()
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    twin = copy.deepcopy(model)
    opt = build_optimizer(validate_section("optimizer", {"type": "Muon", "weight_decay": 0.0}), model, 0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # Each rank saw a different micro-batch: head 0 exploded on rank 1, head 1 on rank 0.
    model.attn.max_logits.copy_(
        torch.tensor([50.0, 400.0, 10.0]) if rank == 0 else torch.tensor([200.0, 10.0, 10.0])
    )
    opt.step()
    ref = build_optimizer(validate_section("optimizer", {"type": "Muon", "weight_decay": 0.0}), twin, 0.0)
    for p in twin.parameters():
        p.grad = torch.zeros_like(p)
    twin.attn.max_logits.copy_(torch.tensor([200.0, 400.0, 10.0]))
    dist.barrier()  # the reference step's all-reduce must pair up across ranks too
    ref.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def _check_qk_clip_on_sharded_masters(mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = MLAModel()
    for p in model.parameters():
        nn.init.normal_(p)
    twin = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    logits = torch.tensor([50.0, 400.0, 150.0])
    before = twin.attn.linear_qb.weight.detach().clone()
    for m in (model, twin):
        m.attn.max_logits.copy_(logits)
        opt = build_optimizer(validate_section("optimizer", {"type": "Muon", "weight_decay": 0.0}), m, 0.0)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.full_tensor(), q), n
    assert not torch.equal(twin.attn.linear_qb.weight, before)  # the clip did fire


def _worker(rank: int, initfile: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        # The default bf16 Newton-Schulz; the same full matrices through the same batched kernels give
        # the single-process result bit for bit.
        single = _run_single("bfloat16", steps=2)
        for strategy in ("allgather", "allgather_deredundency"):
            sharded = _run_sharded(strategy, "bfloat16", 2, mesh)
            for name, ref in single.items():
                assert torch.equal(sharded[name], ref), (
                    f"{strategy} {name}: {(sharded[name] - ref).abs().max()}"
                )
        _check_qk_clip_reduces_across_ranks(rank)
        _check_qk_clip_on_sharded_masters(mesh)
        # Both ranks finish their collectives before either tears gloo down (a rank destroying the group
        # while its peer still sends aborted with 'terminate called without an active exception').
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_rank_comm_strategies_equal_the_single_process_update(tmp_path):
    initfile = str(tmp_path / "pg_init")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(_worker, args=(initfile,), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail("2-rank Muon test timed out")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
