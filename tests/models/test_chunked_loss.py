"""Chunked linear cross-entropy equals the plain path (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.models.common.loss import chunked_linear_cross_entropy, token_cross_entropy
from tiny_fp32 import grads, max_rel, tiny_model


def _inputs(dtype, n=37, h=24, v=301):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[3, 10]] = -100
    mask = (torch.rand(n, generator=g) > 0.2).float()
    return hidden, weight, labels, mask


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_fp32_values_and_grads_equal_the_plain_path(chunk):
    hidden, weight, labels, mask = _inputs(torch.float32)
    ref_sum, ref_n = token_cross_entropy(F.linear(hidden, weight), labels, mask)
    (ref_sum * 0.7).backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got_sum, got_n = chunked_linear_cross_entropy(hidden, weight, labels, mask, chunk)
    (got_sum * 0.7).backward()
    assert got_n == ref_n
    assert max_rel(got_sum, ref_sum) <= 1e-6
    assert max_rel(hidden.grad, ref_gh) <= 1e-6
    assert max_rel(weight.grad, ref_gw) <= 1e-6


def test_bf16_follows_the_plain_numerics():
    hidden, weight, labels, mask = _inputs(torch.bfloat16)
    ref_sum, _ = token_cross_entropy(F.linear(hidden, weight), labels, mask)
    ref_sum.backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got_sum, _ = chunked_linear_cross_entropy(hidden, weight, labels, mask, 8)
    got_sum.backward()
    assert got_sum.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    assert max_rel(got_sum, ref_sum) <= 1e-3
    assert max_rel(hidden.grad, ref_gh) <= 1e-2
    assert max_rel(weight.grad, ref_gw) <= 1e-2


@pytest.mark.parametrize(
    "family,extra",
    [("qwen3", {"tie_word_embeddings": True}), ("deepseek_v3", {"num_nextn_predict_layers": 1})],
)
def test_model_loss_and_grads_equal_with_chunks(family, extra):
    """The model's loss (and MTP losses, with tied and untied output layers) with loss_chunk_size."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.1).float()
    results = []
    for chunk in (0, 7):
        model = tiny_model(family, loss_chunk_size=chunk, **extra)
        out = model(ids, labels=labels, loss_mask=mask)
        out.loss.backward()
        assert (out.logits is None) == (chunk > 0)
        results.append((out, grads(model)))
    (ref, ref_g), (got, got_g) = results
    assert max_rel(got.loss, ref.loss) <= 1e-6
    for key in ref.aux_losses:
        assert max_rel(got.aux_losses[key], ref.aux_losses[key]) <= 1e-6
    assert ref_g.keys() == got_g.keys()
    for name in ref_g:
        assert max_rel(got_g[name], ref_g[name]) <= 1e-5, name


def test_negative_chunk_size_is_refused():
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match="loss_chunk_size"):
        tiny_model("qwen3", loss_chunk_size=-1)
