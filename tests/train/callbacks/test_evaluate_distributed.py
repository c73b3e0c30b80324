"""Validation loss over two data-parallel ranks equals the token mean over all their batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmforge.train.callbacks.validation import evaluate

from .helpers import TinyLM, micro_batches


def _worker(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = TinyLM()
        batches = micro_batches(4, seed=5)
        batches[0]["labels"][:, :6] = -100  # rank 0 has fewer valid tokens than rank 1
        mine = batches[rank::2]
        results[rank] = evaluate(model, mine).loss
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_evaluate_reduces_over_ranks(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    torch.manual_seed(0)
    model = TinyLM()
    batches = micro_batches(4, seed=5)
    batches[0]["labels"][:, :6] = -100
    expected = evaluate(model, batches).loss
    assert results[0] == pytest.approx(expected, rel=1e-6)
    assert results[1] == pytest.approx(expected, rel=1e-6)
