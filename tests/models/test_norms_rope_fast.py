"""The fast RMSNorm and RoPE paths are bitwise the formulas they replaced (issue 15): the pow/mean/rsqrt
chain for the norm, and ``x·cos + rotate_half(x)·sin`` with cos/sin recomputed from the positions every
call for RoPE, forward and backward, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from lmforge.models.common.norms import RMSNorm
from lmforge.models.common.rope import RotaryEmbedding, apply_rope


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float):
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * factor).unsqueeze(1), (emb.sin() * factor).unsqueeze(1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def grads(out: torch.Tensor, inputs, seed: int = 1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 64), (2, 16, 4, 32)])
def test_rms_norm_is_bitwise_the_pow_mean_rsqrt_chain(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    norm = RMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1]) + 0.5)
    out, ref = norm(x), reference_rms_norm(x, norm.weight, 1e-6)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    for a, b in zip(grads(out, (x, norm.weight)), grads(ref, (x, norm.weight)), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}]
)
def test_rope_is_bitwise_rotate_half(dtype, scaling):
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 10000.0, scaling, 256)
    x = torch.randn(2, 3, 24, 32, dtype=dtype, requires_grad=True)
    cached = rope.table(24, x.device)
    assert rope.table(24, x.device)[0] is cached[0]  # computed once per length
    for positions, (cos, sin) in (
        (torch.arange(24)[None], cached),
        (torch.arange(5, 29)[None].expand(2, -1), rope(torch.arange(5, 29)[None].expand(2, -1))),
    ):
        out = apply_rope(x, cos, sin)
        ref = reference_rope(x, positions, rope.inv_freq, rope.attention_factor)
        assert out.dtype == dtype and torch.equal(out, ref)
        assert torch.equal(grads(out, (x,))[0], grads(ref, (x,))[0])


def test_rope_table_cache_is_dropped_when_frequencies_are_reset():
    rope = RotaryEmbedding(16, 10000.0, None, 64)
    first = rope.table(8, torch.device("cpu"))
    rope.reset_parameters()
    again = rope.table(8, torch.device("cpu"))
    assert again[0] is not first[0] and torch.equal(again[0], first[0])
    with torch.inference_mode():
        rope.reset_parameters()
        rope.table(8, torch.device("cpu"))
    assert not rope._tables  # inference tensors are not kept for later training steps
