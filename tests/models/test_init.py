"""Layout-invariant initialisation: values depend on (seed, name, global index) only.

The sharded side (FSDP, TP, PP, CP, EP, HSDP and their combinations, including FSDP over a TP-sharded
dimension) is asserted bit for bit by every case of tests/parallel (``assert_init_matches``)."""

from __future__ import annotations

import torch

from lmforge.config import validate_section
from lmforge.models import build_model
from lmforge.models.common import init


def test_same_seed_same_values_whatever_the_rows_drawn_together():
    whole = torch.empty(1000, 300)
    init.normal_(whole, "w", seed=3, std=0.02)
    strided = torch.empty(1000, 600)[:, :300]  # not contiguous: drawn aside, then copied
    init.normal_(strided, "w", seed=3, std=0.02)
    assert torch.equal(whole, strided)
    wider = torch.empty(1000, 300, dtype=torch.float64)
    init.normal_(wider, "w", seed=3, std=0.02)
    assert torch.equal(wider, whole.double())
    assert abs(float(whole.std()) - 0.02) < 1e-3


def test_seed_and_name_change_the_values_wrapper_segments_do_not():
    a, b, c, d = (torch.empty(8, 8) for _ in range(4))
    init.normal_(a, "decoder.layers.0.mlp.weight", 1, 1.0)
    init.normal_(b, "decoder.layers.1.mlp.weight", 1, 1.0)
    init.normal_(c, "decoder.layers.0.mlp.weight", 2, 1.0)
    init.normal_(d, "decoder.layers.0._checkpoint_wrapped_module.mlp.weight", 1, 1.0)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, d)


def test_meta_build_then_init_equals_a_direct_build_and_fills_everything(tiny_model_section):
    # MLA, MoE with shared experts, a router with expert bias and MTP: every kind of parameter.
    section = tiny_model_section("deepseek_v3", n_shared_experts=1, num_nextn_predict_layers=1)
    direct = build_model(validate_section("model", section), seed=7)
    late = build_model(validate_section("model", section), device="meta")
    late.to_empty(device="cpu")
    with torch.no_grad():
        for p in late.parameters():
            p.fill_(float("nan"))
    late.init_weights(7)
    for (name, p), q in zip(direct.named_parameters(), late.parameters()):
        assert not torch.isnan(q).any(), name
        assert torch.equal(p, q), name


def test_without_a_seed_torch_manual_seed_controls_the_init(tiny_model_section):
    section = tiny_model_section("deepseek_v3")
    torch.manual_seed(5)
    a = build_model(validate_section("model", section))
    torch.manual_seed(5)
    b = build_model(validate_section("model", section))
    torch.manual_seed(6)
    c = build_model(validate_section("model", section))
    w = "embedding.word_embeddings.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])
