"""The chunk body that ``compile: {enable: true}`` compiles (``loss.chunk_loss_and_grad``) gives the same
loss and gradients as the in-place eager chunk loop of the chunked linear cross-entropy."""

from __future__ import annotations

import pytest
import torch

from lmforge.models.common.loss import chunk_loss_and_grad, chunked_linear_cross_entropy


def _loss_and_grads(dtype, chunk_fn):
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16).to(dtype).requires_grad_()
    weight = (torch.randn(50, 16) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 37))
    labels[0, :5] = -100
    mask = (torch.rand(2, 37) > 0.2).float()
    total, n = chunked_linear_cross_entropy(hidden, weight, labels, mask, 16, chunk_fn=chunk_fn)
    (total / n).backward()
    return total.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_function_matches_the_in_place_loop(dtype):
    ref = _loss_and_grads(dtype, None)
    out = _loss_and_grads(dtype, chunk_loss_and_grad)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.slow
def test_compiled_chunk_function_matches_the_in_place_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ref = _loss_and_grads(torch.float32, None)
    out = _loss_and_grads(torch.float32, torch.compile(chunk_loss_and_grad))
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
