"""The shard-clean fused layout (weight layout 2) against layout 1, side by side on one device.

    .venv/bin/python bench/fused_layout.py [--rounds R] [--steps N] [--dtype float32|bfloat16]

Layout 2 (``models/common/fused_layout.py``) reads the fused projections' outputs through strided views
(QKV per key-value group, gate/up row pairs) where layout 1 took contiguous blocks (``split`` /
``chunk``). This measures forward + backward of lmforge's ``SelfAttention`` (GQA) and ``SwiGLUMLP``
against the same modules with layout 1's forward (weights permuted so both compute the same function),
alternating rounds; reports the median time per step and the ratio layout 2 / layout 1 (below 1:
layout 2 is faster). The outputs are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lmforge.models.common.attention import SelfAttention
from lmforge.models.common.fused_layout import gate_up_rows, qkv_rows
from lmforge.models.common.mlp import SwiGLUMLP
from lmforge.models.common.rope import RotaryEmbedding, apply_rope


def mlp_layout1(m: SwiGLUMLP, w1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return m.linear_fc2(F.silu(gate) * up)


def attn_layout1(m: SelfAttention, w: torch.Tensor, x, cos, sin) -> torch.Tensor:
    b, s, _ = x.shape
    q, k, v = F.linear(x, w).split([m.q_rows, m.kv_rows, m.kv_rows], dim=-1)
    q = apply_rope(q.view(b, s, m.num_heads, m.head_dim).transpose(1, 2), cos, sin)
    k = apply_rope(k.view(b, s, m.num_kv_heads, m.head_dim).transpose(1, 2), cos, sin)
    v = v.view(b, s, m.num_kv_heads, m.head_dim).transpose(1, 2)
    out = m.core_attention(q, k, v, None)
    return m.linear_proj(out.transpose(1, 2).reshape(b, s, m.q_rows))


def timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn().float().sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    h, d = a.hidden, a.hidden // a.heads
    mlp = SwiGLUMLP(h, a.ffn).to(dtype)
    attn = SelfAttention(h, a.heads, a.kv_heads, d).to(dtype)
    w1_old = mlp.linear_fc1.weight.detach()[torch.argsort(gate_up_rows(a.ffn))].clone().requires_grad_()
    qkv_old = (
        attn.linear_qkv.weight.detach()[torch.argsort(qkv_rows(a.heads, a.kv_heads, d))]
        .clone()
        .requires_grad_()
    )
    x = torch.randn(a.batch, a.seq, h, dtype=dtype, requires_grad=True)
    cos, sin = RotaryEmbedding(d, 10000.0, None, a.seq)(torch.arange(a.seq)[None])
    cases = {
        "SwiGLU MLP": (lambda: mlp(x), lambda: mlp_layout1(mlp, w1_old, x)),
        "GQA attention": (lambda: attn(x, cos, sin, None), lambda: attn_layout1(attn, qkv_old, x, cos, sin)),
    }
    with torch.no_grad():
        for name, (new, old) in cases.items():
            torch.testing.assert_close(new(), old(), atol=1e-4, rtol=1e-3, msg=name)
    print(
        f"threads {torch.get_num_threads()}, {a.dtype}, batch {a.batch} x seq {a.seq}, hidden {h}, "
        f"ffn {a.ffn}, heads {a.heads}/{a.kv_heads}"
    )
    print("| block (fwd+bwd) | layout 1 ms | layout 2 ms | layout 2 / layout 1 |")
    print("|---|---|---|---|")
    for name, (new, old) in cases.items():
        timed(new, 1), timed(old, 1)  # warm-up
        t_new, t_old = [], []
        for _ in range(a.rounds):
            t_new.append(timed(new, a.steps))
            t_old.append(timed(old, a.steps))
        n, o = statistics.median(t_new), statistics.median(t_old)
        print(f"| {name} | {o * 1e3:.1f} | {n * 1e3:.1f} | {n / o:.3f} |")


if __name__ == "__main__":
    main()
