"""Document masking from actual_seq_len without a dense mask equals the dense-mask path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.models.common.attention import segment_attention
from lmforge.models.common.masks import (
    DocumentSegments,
    attention_layout,
    build_allowed_mask,
    document_spans,
)
from tiny_fp32 import grads, max_rel, tiny_model


def test_spans_follow_the_document_ids_rule():
    # Token t belongs to document #{ends <= t}: 0 and S add nothing, repeats are empty documents.
    got = document_spans(torch.tensor([[3, 3, 7, 10, 10], [0, 10, 10, 10, 10]]), 10)
    assert got.spans == (((0, 3), (3, 7), (7, 10)), ((0, 10),))
    assert document_spans(torch.tensor([4, 10]), 10).spans == (((0, 4), (4, 10)),)
    # An offset list that stops short of S leaves the tail as its own document.
    assert document_spans(torch.tensor([[2, 5]]), 8).spans == (((0, 2), (2, 5), (5, 8)),)


def test_dense_equivalent_matches_build_allowed_mask():
    ends = torch.tensor([[3, 3, 7, 10, 10], [5, 10, 10, 10, 10]])
    seg = document_spans(ends, 10)
    assert torch.equal(
        seg.dense(torch.device("cpu")), build_allowed_mask(10, torch.device("cpu"), None, ends)
    )


def test_layout_is_plain_causal_for_one_document_per_row():
    assert attention_layout(8, torch.device("cpu"), None, torch.tensor([[8, 8], [8, 8]])) is None
    assert isinstance(
        attention_layout(8, torch.device("cpu"), None, torch.tensor([[3, 8]])), DocumentSegments
    )


@pytest.mark.parametrize("shared", [True, False])
def test_segment_attention_equals_the_dense_mask(shared):
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 24, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    ends = torch.tensor([5, 6, 17, 24]) if shared else torch.tensor([[5, 6, 17, 24], [11, 24, 24, 24]])
    dense = build_allowed_mask(s, q.device, None, ends)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.3, enable_gqa=True)
    weight = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    got = segment_attention(q, k, v, document_spans(ends, s), 0.3)
    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    assert max_rel(got, ref) <= 1e-6
    for a, r in zip(got_grads, ref_grads, strict=True):
        assert max_rel(a, r) <= 1e-6


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_model_with_actual_seq_len_equals_the_dense_mask(family):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    ends = torch.tensor([[4, 9, 16], [7, 16, 16]])
    dense = ~build_allowed_mask(16, ids.device, None, ends)  # Megatron layout: True = masked
    runs = []
    for kwargs in ({"attention_mask": dense}, {"actual_seq_len": ends}):
        model = tiny_model(family)
        model.track_max_logits = True
        out = model(ids, labels=labels, **kwargs)
        out.loss.backward()
        maxes = [m.core_attention.max_logits.clone() for _, m in model._attention_modules()]
        runs.append((out.loss, grads(model), maxes))
    (ref, ref_g, ref_m), (got, got_g, got_m) = runs
    assert max_rel(got, ref) <= 1e-6
    for name in ref_g:
        assert max_rel(got_g[name], ref_g[name]) <= 1e-5, name
    for a, r in zip(got_m, ref_m, strict=True):
        assert max_rel(a, r) <= 1e-6
