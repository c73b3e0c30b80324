"""The row layouts of lmforge's fused weights (weight layout 2), and their map from layout 1.

Layout 2 stores every fused projection so that a plain split of its rows into ``t`` equal chunks (a
``Shard(0)`` / ``ColwiseParallel`` weight) gives each rank whole logical units, for every ``t`` that
divides the number of units, and the model splits its output with views computed from the tensor's
own width (so a rank holding a chunk needs no per-rank head counts):

* GQA ``linear_qkv``: per key-value group g = 0..G-1, ``[q rows of the group's H/G heads; k_g; v_g]``
  (Megatron's layout). Unit: one key-value group; ``t`` must divide G.
* SwiGLU ``linear_fc1`` (and each expert of ``experts.linear_fc1``): rows in pairs
  ``[gate_0; up_0; gate_1; up_1; ...]``. Unit: one pair; ``t`` must divide the FFN width. (Pairs rather
  than blocks: the only interleave that splits at every ``t`` dividing the width.)
* MLA up projections (Hugging Face's ``q_b_proj`` / ``kv_b_proj`` layout): per head
  ``[q_nope_h; q_rope_h]`` and ``[k_nope_h; v_h]``. Unit: one head.

Layout 1 (checkpoints written before ``weight_layout`` appeared in ``common.json``) stored the pieces as
contiguous blocks ``[Q; K; V]``, ``[gate; up]``, ``[all nope; all rope]``. Each function below returns
``rows`` with ``layout2 = layout1[rows]``; ``argsort(rows)`` goes back.
"""

from __future__ import annotations

import torch

WEIGHT_LAYOUT = 2


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Layout-1 row of each layout-2 row of a GQA ``linear_qkv`` (``[Q; K; V]`` → per group)."""
    g, r, d = num_kv_heads, num_heads // num_kv_heads, head_dim
    q = torch.arange(num_heads * d).view(g, r * d)
    k = num_heads * d + torch.arange(g * d).view(g, d)
    v = (num_heads + g) * d + torch.arange(g * d).view(g, d)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def gate_up_rows(ffn_hidden_size: int) -> torch.Tensor:
    """Layout-1 row of each layout-2 row of a SwiGLU ``linear_fc1`` (``[gate; up]`` → pairs)."""
    f = torch.arange(ffn_hidden_size)
    return torch.stack([f, ffn_hidden_size + f], dim=1).reshape(-1)


def per_head_rows(num_heads: int, first: int, second: int) -> torch.Tensor:
    """Layout-1 row of each layout-2 row of an MLA up projection (``[all first; all second]`` → per head)."""
    a = torch.arange(num_heads * first).view(num_heads, first)
    b = num_heads * first + torch.arange(num_heads * second).view(num_heads, second)
    return torch.cat([a, b], dim=1).reshape(-1)
