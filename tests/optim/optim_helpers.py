"""Small hand-written models that implement the optimizer hooks (no lmforge model needed)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lmforge.utils.qk_clip import QKClipLayer, QKClipTarget


class TinyLM(nn.Module):
    """Megatron-style names: embedding, a layer with fused qkv / mlp, norms, biases, output layer."""

    def __init__(
        self, vocab: int = 32, hidden: int = 16, ffn: int = 24, tie: bool = False, dtype=torch.float32
    ):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.decoder = nn.Module()
        layer = nn.Module()
        layer.input_layernorm = nn.LayerNorm(hidden)
        layer.self_attention = nn.Module()
        layer.self_attention.linear_qkv = nn.Linear(hidden, 3 * hidden)
        layer.self_attention.linear_proj = nn.Linear(hidden, hidden, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        layer.mlp.linear_fc2 = nn.Linear(ffn, hidden, bias=False)
        self.decoder.layers = nn.ModuleList([layer])
        self.decoder.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.output_layer.weight = self.embedding.word_embeddings.weight
        self.to(dtype)

    def no_weight_decay_names(self):
        return {"embedding.word_embeddings.weight"}


def set_random_grads(model: nn.Module, seed: int, dtype=None) -> dict[str, torch.Tensor]:
    """Give every parameter a reproducible gradient; returns the fp32 values by name."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen)
        out[name] = g
        p.grad = g.to(dtype or p.dtype)
    return out


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class MLAAttention(nn.Module):
    """MLA-like projections: linear_qb rows per head [q_nope | q_rope]; linear_kvb rows per head [k_nope | v];
    the shared rope key lives in linear_kv_down (never clipped)."""

    def __init__(self, heads=3, nope=4, rope=2, v=5, hidden=8, qk_norm=False):
        super().__init__()
        self.heads, self.nope, self.rope, self.v = heads, nope, rope, v
        self.linear_qb = nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.linear_kvb = nn.Linear(hidden, heads * (nope + v), bias=False)
        self.linear_kv_down = nn.Linear(hidden, rope + hidden, bias=False)
        self.max_logits = torch.zeros(heads)
        self.qk_norm = qk_norm

    def clip_layer(self, prefix: str) -> QKClipLayer:
        H, n, r, v = self.heads, self.nope, self.rope, self.v
        q_nope = torch.stack([torch.arange(h * (n + r), h * (n + r) + n) for h in range(H)])
        q_rope = torch.stack([torch.arange(h * (n + r) + n, (h + 1) * (n + r)) for h in range(H)])
        k_nope = torch.stack([torch.arange(h * (n + v), h * (n + v) + n) for h in range(H)])
        heads = torch.arange(H).view(H, 1)
        return QKClipLayer(
            name=prefix,
            max_logits=self.max_logits,
            targets=[
                QKClipTarget(f"{prefix}.linear_qb.weight", 0, q_nope, heads, 0.5),
                QKClipTarget(f"{prefix}.linear_qb.weight", 0, q_rope, heads, 1.0),
                QKClipTarget(f"{prefix}.linear_kvb.weight", 0, k_nope, heads, 0.5),
            ],
            qk_norm=self.qk_norm,
        )


class MLAModel(nn.Module):
    def __init__(self, qk_norm=False):
        super().__init__()
        self.attn = MLAAttention(qk_norm=qk_norm)
        self.track_max_logits = False
        self.resets = 0

    def qk_clip_layers(self):
        return [self.attn.clip_layer("attn")]

    def reset_max_logits(self):
        self.attn.max_logits.zero_()
        self.resets += 1


class GQAModel(nn.Module):
    """4 query heads, 2 KV groups (heads 0,1 -> kv 0; heads 2,3 -> kv 1), head_dim 3."""

    def __init__(self, hidden=8, d=3):
        super().__init__()
        self.q = nn.Linear(hidden, 4 * d, bias=False)
        self.k = nn.Linear(hidden, 2 * d, bias=False)
        self.max_logits = torch.zeros(4)
        self.d = d

    def qk_clip_layers(self):
        d = self.d
        q_rows = torch.stack([torch.arange(h * d, (h + 1) * d) for h in range(4)])
        k_rows = torch.stack([torch.arange(g * d, (g + 1) * d) for g in range(2)])
        return [
            QKClipLayer(
                "gqa",
                self.max_logits,
                [
                    # Per KV group: both q heads of a group and its key share the group's gamma.
                    QKClipTarget("q.weight", 0, q_rows, torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]]), 0.5),
                    QKClipTarget("k.weight", 0, k_rows, torch.tensor([[0, 1], [2, 3]]), 0.5),
                ],
            )
        ]
