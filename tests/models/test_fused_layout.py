"""Fused weights are drawn in their logical row order: one seed gives the same model in every storage layout."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import validate_section
from lmforge.models import build_model
from lmforge.models.common import init
from lmforge.train.checkpoint.compat.fused_layout_v1 import fused_rows


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_fused_weights_are_the_logical_draw_permuted_into_the_stored_layout(family, tiny_model_section):
    model = build_model(validate_section("model", tiny_model_section(family)), seed=5)
    names = {id(p): n for n, p in model.named_parameters()}
    checked = 0
    for p, dim, rows, _ in fused_rows(model):
        if not names[id(p)].endswith(".weight") or ".lora_" in names[id(p)]:
            continue
        logical = torch.empty_like(p)
        init.normal_(logical, names[id(p)], 5, model.config.initializer_range)  # drawn [Q; K; V] / [gate; up]
        assert torch.equal(p.detach(), logical.index_select(dim, rows)), names[id(p)]
        checked += 1
    assert checked >= 2
