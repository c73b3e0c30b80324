"""Hooks for Muon (split schema), QK-Clip (max logits and targets) and MFU (FLOPs per token)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import lmforge.models.common.moe as moe_module
from lmforge.models import save_hf_pretrained

FAMILIES = ["llama", "qwen3", "deepseek_v3"]
HF_MODULES = {
    "llama": "transformers.models.llama.modeling_llama",
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
    "deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3",
}


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_moe"])
def test_muon_split_schema_covers_fused_weights(family, tiny):
    extra = (
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        if family == "qwen3_moe"
        else {}
    )
    if family == "qwen3_moe":
        model = tiny("qwen3", **extra, model_type="qwen3_moe", architectures="Qwen3MoeForCausalLM")
    else:
        model = tiny(family)
    schema = model.muon_split_schema()
    params = dict(model.named_parameters())
    for name, split in schema.items():
        assert sum(split.sizes) == params[name].shape[split.dim], name
        if split.order is not None:  # a permutation of the stored rows
            assert torch.equal(split.order.sort().values, torch.arange(params[name].shape[split.dim])), name
    fused = [n for n in params if n.endswith(("linear_qkv.weight", "linear_fc1.weight", "_up_proj.weight"))]
    assert fused and all(n in schema for n in fused)
    if family == "deepseek_v3":
        assert schema["decoder.layers.1.mlp.experts.linear_fc1.weight"].sizes == [32, 32]
        assert schema["decoder.layers.0.self_attention.linear_q_up_proj.weight"].sizes == [4 * 16, 4 * 8]
        assert schema["decoder.layers.0.self_attention.linear_kv_up_proj.weight"].sizes == [4 * 16, 4 * 16]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_muon_pieces_are_the_hugging_face_projections(family, tiny):
    """Muon orthogonalises Q, K, V, gate and up as whole matrices, whatever the stored row layout."""
    from lmforge.models.registry import family_for
    from lmforge.utils.muon_split import split_pieces

    model = tiny(family)
    hf = family_for(model.config.model_type).hf_adapter.to_hf(model.state_dict(), model.config)
    schema = model.muon_split_schema()
    params = dict(model.named_parameters())
    q, k, v = split_pieces(
        params["decoder.layers.1.self_attention.linear_qkv.weight"],
        schema["decoder.layers.1.self_attention.linear_qkv.weight"],
    )
    for piece, hf_name in zip((q, k, v), ("q_proj", "k_proj", "v_proj")):
        assert torch.equal(piece, hf[f"model.layers.1.self_attn.{hf_name}.weight"])
    gate, up = split_pieces(
        params["decoder.layers.0.mlp.linear_fc1.weight"], schema["decoder.layers.0.mlp.linear_fc1.weight"]
    )
    assert torch.equal(gate, hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, hf["model.layers.0.mlp.up_proj.weight"])


def _hf_max_logits(model, tmp_path, family, monkeypatch, ids):
    """Per-layer per-head max of q·k·scale (causal) computed inside transformers' eager attention."""
    import transformers

    save_hf_pretrained(model, tmp_path)
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
        .float()
        .eval()
    )
    module = importlib.import_module(HF_MODULES[family])
    original = module.eager_attention_forward
    found = []

    def spy(mod, query, key, value, attention_mask, scaling, **kw):
        key_full = module.repeat_kv(key, mod.num_key_value_groups)
        logits = torch.matmul(query, key_full.transpose(2, 3)) * scaling
        s = logits.shape[-1]
        logits = logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        found.append(logits.amax(dim=(0, 2, 3)))
        return original(mod, query, key, value, attention_mask, scaling, **kw)

    monkeypatch.setattr(module, "eager_attention_forward", spy)
    with torch.no_grad():
        hf(input_ids=ids)
    return found


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("llama", {"attention_bias": True}), ("qwen3", {}), ("deepseek_v3", {})],
)
def test_max_logits_match_transformers_and_qk_clip_targets_bound_them(
    family, overrides, tiny, tmp_path, monkeypatch
):
    model = tiny(family, initializer_range=0.3, **overrides)
    if overrides:
        with torch.no_grad():
            model.decoder.layers[0].self_attention.linear_qkv.bias.normal_(0, 1.0)
            model.decoder.layers[1].self_attention.linear_qkv.bias.normal_(0, 1.0)
    ids = torch.randint(0, 128, (2, 16))
    model.track_max_logits = True
    with torch.no_grad():
        model(ids[:1])
        model(ids[1:])  # running max over two micro-batches
    layers = model.qk_clip_layers()
    assert [layer.name for layer in layers] == [f"decoder.layers.{i}.self_attention" for i in range(2)]
    reference = _hf_max_logits(model, tmp_path, family, monkeypatch, ids)
    for layer, ref in zip(layers, reference):
        assert torch.allclose(layer.max_logits, ref, atol=1e-4), (layer.max_logits, ref)

    # Apply QK-Clip as documented in lmforge.utils.qk_clip to one layer at a time (clipping a layer changes
    # the inputs of the layers after it), with tau below that layer's current maximum.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    maxima = [layer.max_logits.clone() for layer in layers]  # the live buffers change below
    for index, layer in enumerate(layers):
        model.load_state_dict(state)
        tau = 0.5 * float(maxima[index].max())
        _apply_qk_clip(model, layer, maxima[index], tau)
        model.reset_max_logits()
        with torch.no_grad():
            model(ids)
        after = model.qk_clip_layers()[index].max_logits
        assert float(after.max()) <= tau * (1 + 1e-4)
        assert float(after.max()) >= tau * 0.5  # clipped to the threshold, not far below it
    model.load_state_dict(state)
    model.reset_max_logits()
    assert all(float(layer.max_logits.abs().max()) == 0.0 for layer in layers)


def _apply_qk_clip(model, layer, max_logits, tau: float) -> None:
    params = dict(model.named_parameters())
    gamma = torch.clamp(tau / max_logits, max=1.0)
    with torch.no_grad():
        for t in layer.targets:
            p = params[t.param_name]
            for g in range(t.rows.shape[0]):
                factor = gamma[t.heads[g]].min() ** t.exponent
                p.index_copy_(t.dim, t.rows[g], p.index_select(t.dim, t.rows[g]) * factor)


def test_max_logits_not_tracked_when_off(tiny):
    model = tiny("llama")
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8)))
    assert all(float(layer.max_logits.abs().max()) == 0.0 for layer in model.qk_clip_layers())


def _loop_grouped_matmul(x, weight, counts):
    # Exact per-expert matmuls, so the FLOP counter sees only active experts (no padding).
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        out.append(x[start : start + c] @ weight[e].T)
        start += c
    return torch.cat(out)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", {"tie_word_embeddings": True}),
        ("qwen3", {}),
        ("deepseek_v3", {"num_nextn_predict_layers": 1}),
        ("deepseek_v3", {"q_lora_rank": None, "n_routed_experts": 0}),
    ],
)
def test_flops_per_token_matches_torch_flop_counter(family, overrides, tiny, monkeypatch):
    monkeypatch.setattr(moe_module, "grouped_matmul", _loop_grouped_matmul)
    # The plain loss: the chunked one computes its backward matmuls inside forward (as addmm_ and mm out=).
    model = tiny(family, loss_chunk_size=0, **overrides).train()
    seq = 24
    ids = torch.randint(0, 128, (1, seq))
    # The math SDPA backend is plain bmm's, which the counter sees (the fused CPU kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / seq
    assert counted == pytest.approx(model.flops_per_token(seq), rel=1e-9)
