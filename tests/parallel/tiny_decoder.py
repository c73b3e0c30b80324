"""A tiny decoder with Megatron module names, independent of lmforge.models (for activation tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.linear_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.linear_qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(-1), p=0.1, training=self.training)
        out = (probs @ v).transpose(1, 2).reshape(b, s, h)
        return self.linear_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 8 * hidden, bias=False)
        self.linear_fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attention = Attention(hidden, heads)
        self.pre_mlp_layernorm = nn.RMSNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, hidden: int, heads: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(num_layers))
        self.final_layernorm = nn.RMSNorm(hidden)


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, num_layers: int = 4) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.decoder = Decoder(hidden, heads, num_layers)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding.word_embeddings(input_ids)
        for layer in self.decoder.layers:
            x = layer(x)
        logits = self.output_layer(self.decoder.final_layernorm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
