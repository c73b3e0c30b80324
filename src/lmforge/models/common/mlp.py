"""SwiGLU MLP with the fused ``linear_fc1`` (rows ``[gate (F); up (F)]``) and ``linear_fc2``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.ffn_hidden_size = ffn_hidden_size
        self.linear_fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=bias)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)

    def muon_split_schema(self, prefix: str) -> dict[str, tuple[int, list[int]]]:
        f = self.ffn_hidden_size
        return {f"{prefix}.linear_fc1.weight": (0, [f, f])}

    def flops_per_token(self, hidden_size: int) -> float:
        return 2 * hidden_size * 2 * self.ffn_hidden_size + 2 * self.ffn_hidden_size * hidden_size
