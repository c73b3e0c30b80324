"""Compiled with dynamic shapes (what a recompile after a shape change gives), the GQA attention core is
one graph: ``enable_gqa`` must reach SDPA as a bool, not a SymBool (a graph break at every call)."""

from __future__ import annotations

import torch

from lmforge.models.common.attention import CoreAttention


def test_gqa_core_attention_compiles_as_one_graph_with_dynamic_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    core = CoreAttention(num_heads=4, scale=0.25)
    compiled = torch.compile(core, fullgraph=True, dynamic=True, backend="eager")  # a graph break raises
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    torch.testing.assert_close(compiled(q, k, v, None), core(q, k, v, None))
