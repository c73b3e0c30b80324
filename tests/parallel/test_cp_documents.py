"""Context-parallel attention over document spans equals the dense-mask attention (one process).

The ranks are simulated: each one's query chunks (load-balanced order, or a hybrid group's chunks)
attend the whole sequence's K/V as they would after the all-gather. The reference is SDPA with the
dense ``[B, 1, S, S]`` may-attend mask; fp32, outputs and gradients within 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.models.common.attention import CoreAttention
from lmforge.models.common.masks import build_allowed_mask, document_spans
from lmforge.parallel.cp import (
    _attend_chunks,
    chunk_document_attention,
    chunk_order,
    local_positions,
    lower_right_causal_attention,
)

B, HQ, HKV, D, SCALE = 2, 4, 2, 8, 0.3


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def _qkv(seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, seq, D, generator=g, requires_grad=True) for h in (HQ, HKV, HKV)]


def _positions(chunks: list[int], c: int) -> torch.Tensor:
    return torch.cat([torch.arange(g * c, (g + 1) * c) for g in chunks])


def _rank_chunks(cp: int, u: int = 1) -> list[list[int]]:
    """The query chunks each rank (each Ulysses group of u ranks in hybrid) attends with."""
    return [[g for r in range(a * u, (a + 1) * u) for g in (r, 2 * cp - 1 - r)] for a in range(cp // u)]


@pytest.mark.parametrize("lq,lk", [(5, 5), (3, 11), (1, 7), (7, 8)])
def test_lower_right_causal_equals_its_dense_mask(lq, lk):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, lq, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, HKV, lk, D, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
    got = lower_right_causal_attention(q, k, v, SCALE, 0.0, True)
    w = torch.randn(ref.shape, generator=g)
    ref_g = torch.autograd.grad((ref * w).sum(), (q, k, v))
    got_g = torch.autograd.grad((got * w).sum(), (q, k, v))
    assert max_rel(got, ref) <= 1e-6
    for a, r in zip(got_g, ref_g, strict=True):
        assert max_rel(a, r) <= 1e-6


ENDS = {
    # documents crossing chunk boundaries, one inside a chunk, empty ones, a row of one document
    "per_row": torch.tensor([[5, 6, 17, 32, 32], [11, 32, 32, 32, 32]]),
    "shared": torch.tensor([3, 9, 10, 25, 32]),
    "boundaries": torch.tensor([[4, 8, 12, 32], [16, 20, 32, 32]]),
}


@pytest.mark.parametrize("ends", ENDS, ids=list(ENDS))
@pytest.mark.parametrize("cp,u", [(2, 1), (4, 1), (4, 2)])
def test_rank_chunks_equal_the_dense_mask(ends, cp, u):
    s = 32
    c = s // (2 * cp)
    q, k, v = _qkv(s)
    dense = build_allowed_mask(s, q.device, None, ENDS[ends])
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=SCALE, enable_gqa=True)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    ref_g = torch.autograd.grad((ref * w).sum(), (q, k, v))
    segments = document_spans(ENDS[ends], s)
    loss = 0.0
    for chunks in _rank_chunks(cp, u):
        pos = _positions(chunks, c)
        out = chunk_document_attention(q[:, :, pos], k, v, chunks, segments, SCALE)
        assert max_rel(out, ref[:, :, pos]) <= 1e-6
        loss = loss + (out * w[:, :, pos]).sum()
    got_g = torch.autograd.grad(loss, (q, k, v))
    for a, r in zip(got_g, ref_g, strict=True):
        assert max_rel(a, r) <= 1e-6


@pytest.mark.parametrize("with_docs", [True, False])
def test_gathered_kv_attention_matches_the_dense_path_with_max_logits(with_docs):
    """``_attend_chunks`` on K/V in gathered (chunk_order) layout: spans (or plain causal) vs the dense mask."""
    cp, s = 2, 32
    c = s // (2 * cp)
    q, k, v = _qkv(s, seed=4)
    ends = ENDS["per_row"]
    dense = build_allowed_mask(s, q.device, None, ends if with_docs else None)
    if dense is None:
        dense = build_allowed_mask(s, q.device, torch.zeros(s, s, dtype=torch.bool))
    gathered = torch.cat([local_positions(2 * c, cp, r, q.device) for r in range(cp)])
    assert gathered.tolist() == _positions(chunk_order(cp), c).tolist()
    results = []
    for doc in (dense, document_spans(ends, s) if with_docs else None):
        k_all, v_all = k[:, :, gathered], v[:, :, gathered]
        core = CoreAttention(HQ, SCALE)
        core.track_max_logits = True
        outs = []
        for rank in range(cp):
            chunks = [rank, 2 * cp - 1 - rank]
            outs.append(
                _attend_chunks(core, q[:, :, _positions(chunks, c)], k_all, v_all, chunks, cp, doc, 0)
            )
        out = torch.cat(outs, dim=2)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, grads, core.max_logits.clone()))
    (ref, ref_g, ref_m), (got, got_g, got_m) = results
    assert ref_m.gt(0).all()
    assert max_rel(got, ref) <= 1e-6
    assert max_rel(got_m, ref_m) <= 1e-6
    for a, r in zip(got_g, ref_g, strict=True):
        assert max_rel(a, r) <= 1e-6


def test_shard_batch_keeps_spans_not_a_dense_mask():
    from lmforge.models.common.masks import DocumentSegments
    from lmforge.parallel.cp import DocumentMask, shard_batch

    ids = torch.arange(32).view(2, 16)
    doc = DocumentMask()
    out = shard_batch({"input_ids": ids, "actual_seq_len": torch.tensor([[5, 16], [9, 16]])}, 2, 1, doc)
    assert "actual_seq_len" not in out and out["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert isinstance(doc.layout, DocumentSegments)
    assert doc.layout.spans == (((0, 5), (5, 16)), ((0, 9), (9, 16)))
    shard_batch({"input_ids": ids, "actual_seq_len": torch.tensor([[16], [16]])}, 2, 0, doc)
    assert doc.layout is None  # one document per row: plain causal
    dense = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    shard_batch({"input_ids": ids, "attention_mask": dense}, 2, 0, doc)
    assert isinstance(doc.layout, torch.Tensor) and doc.layout.shape == (2, 1, 16, 16)
