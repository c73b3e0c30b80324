"""Muon's update of a fused weight does not depend on the row layout it is stored in.

A tiny DeepSeek-V3 (MLA up projections per head, SwiGLU and expert gate/up pairs) and a tiny Llama
(QKV grouped per key-value group) are stepped by Muon next to a twin that holds the same weights in
layout 1 (contiguous ``[Q; K; V]``, ``[gate; up]``, MLA parts) with the plain block split schema: the
updates are the same matrices, row for row.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.config import validate_section
from lmforge.models import build_model
from lmforge.optim import build_optimizer
from lmforge.train.checkpoint.compat.fused_layout_v1 import fused_rows
from lmforge.utils.muon_split import MuonSplit

SECTIONS = {
    "llama": dict(
        model_type="llama", architectures="LlamaForCausalLM", num_key_value_heads=2, attention_bias=True
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        architectures="DeepseekV3ForCausalLM",
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=6,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=6,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
    ),
}


class _Flat(nn.Module):
    """The parameters of a model under their names, with a given split schema."""

    def __init__(self, tensors: dict[str, torch.Tensor], schema: dict) -> None:
        super().__init__()
        self.names = list(tensors)
        self.params = nn.ParameterList(nn.Parameter(t.clone()) for t in tensors.values())
        self.schema = schema

    def muon_split_schema(self):
        return {f"params.{i}": self.schema[n] for i, n in enumerate(self.names) if n in self.schema}


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_muon_updates_are_the_same_in_layout_1_and_layout_2(family):
    torch.manual_seed(0)
    section = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=4 if family == "llama" else 2,
        compute_dtype="float32",
        **SECTIONS[family],
    )
    model = build_model(validate_section("model", section))
    names = {id(p): n for n, p in model.named_parameters()}
    rows = {names[id(p)]: (dim, r) for p, dim, r, _ in fused_rows(model)}
    schema = {k: MuonSplit(*v) for k, v in model.muon_split_schema().items()}
    new = {n: p.detach() for n, p in model.named_parameters()}
    # layout 1 = layout 2 with its rows put back: old[rows] = new.
    old = {
        n: (t.index_select(rows[n][0], torch.argsort(rows[n][1])) if n in rows else t) for n, t in new.items()
    }
    old_schema = {n: MuonSplit(s.dim, s.sizes) for n, s in schema.items()}
    assert any(s.order is not None for s in schema.values())
    a, b = _Flat(new, schema), _Flat(old, old_schema)
    opts = [
        build_optimizer(
            validate_section("optimizer", {"type": "Muon", "ns_dtype": "float32", "qk_clip_enabled": False}),
            m,
            0.02,
        )
        for m in (a, b)
    ]
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for (n, pa), pb in zip(zip(a.names, a.params), b.params):
            grad = torch.randn(pa.shape, generator=g)
            pa.grad = grad
            pb.grad = grad.index_select(rows[n][0], torch.argsort(rows[n][1])) if n in rows else grad.clone()
        for opt in opts:
            opt.step()
    for n, pa, pb in zip(a.names, a.params, b.params):
        back = pb.index_select(rows[n][0], rows[n][1]) if n in rows else pb
        torch.testing.assert_close(pa, back, atol=1e-6, rtol=0, msg=n)
