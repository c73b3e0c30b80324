"""Layout-invariant initialisation: values depend on (seed, name, global index) only.

The sharded side (FSDP, TP, PP, CP, EP, HSDP and their combinations, including FSDP over a TP-sharded
dimension) is asserted bit for bit by every case of tests/parallel (``assert_init_matches``)."""

from __future__ import annotations

import torch

from lmforge.models import build_model
from lmforge.models.common import init


def tiny_deepseek(**overrides):
    """MLA, MoE with shared experts and a router with expert bias: every kind of parameter."""
    section = {
        "model_type": "deepseek_v3",
        "architectures": "DeepseekV3ForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "vocab_size": 64,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "num_nextn_predict_layers": 0,
        "compute_dtype": "float32",
    }
    section.update(overrides)
    return section


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


def test_meta_build_then_init_equals_a_direct_build_and_fills_everything():
    section = tiny_deepseek(num_nextn_predict_layers=1)
    direct = build_model(section, seed=7)
    late = build_model(section, device="meta")
    late.to_empty(device="cpu")
    with torch.no_grad():
        for p in late.parameters():
            p.fill_(float("nan"))
    late.init_weights(7)
    for (name, p), q in zip(direct.named_parameters(), late.parameters()):
        assert not torch.isnan(q).any(), name
        assert torch.equal(p, q), name


def test_without_a_seed_torch_manual_seed_controls_the_init():
    section = tiny_deepseek()
    torch.manual_seed(5)
    a = build_model(section)
    torch.manual_seed(5)
    b = build_model(section)
    torch.manual_seed(6)
    c = build_model(section)
    w = "embedding.word_embeddings.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])
