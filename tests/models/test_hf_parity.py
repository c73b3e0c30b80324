"""Parity with Hugging Face transformers' own model classes (fp32, random weights made here)."""

from __future__ import annotations

import pytest
import torch

from lmforge.models import load_hf_pretrained, save_hf_pretrained

CASES = {
    "llama": {},
    "llama_tied_llama3_rope": dict(
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen3": {},
    "qwen3_moe": dict(norm_topk_prob=True, mlp_only_layers=[0]),
    "deepseek_v3": {},
    "deepseek_v3_no_q_lora": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1),
}


def _family(case: str) -> str:
    return next(f for f in ("qwen3_moe", "qwen3", "llama", "deepseek_v3") if case.startswith(f))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory, make_hf_model):
    case = request.param
    hf = make_hf_model(_family(case), **CASES[case])
    path = tmp_path_factory.mktemp(case)
    hf.save_pretrained(path)
    ours = load_hf_pretrained(path).eval()
    return case, hf, ours, path


def test_logits_and_loss_match_transformers(pair):
    case, hf, ours, _ = pair
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        # HF shifts labels inside its loss; lmforge takes them already shifted (labels[t] is the target of t).
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        out = ours(ids, labels=labels)  # the loss by chunks (the default loss_chunk_size): no logits
        logits = ours(ids).logits
    assert ours.compute_dtype == torch.float32
    diff = (logits - ref.logits).abs().max().item()
    assert diff <= 1e-4, f"{case}: max |logit diff| {diff}"
    assert torch.allclose(out.loss_sum / out.num_tokens, ref.loss, atol=1e-5, rtol=0)
    assert out.num_tokens.item() == 2 * 23


def test_roundtrip_lmforge_hf_lmforge_is_exact(pair, tmp_path):
    case, _, ours, _ = pair
    save_hf_pretrained(ours, tmp_path / "hf")
    again = load_hf_pretrained(tmp_path / "hf")
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_saved_directory_loads_in_transformers(pair, tmp_path):
    case, hf, ours, _ = pair
    import transformers

    save_hf_pretrained(ours, tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - hf(input_ids=ids).logits).abs().max() <= 1e-5


def test_sharded_checkpoint_and_transformers4_rope_keys(tmp_path, make_hf_model):
    """A sharded safetensors index loads; a transformers-4 style config.json (rope_theta + rope_scaling)
    means the same as transformers 5's rope_parameters."""
    import json

    hf = make_hf_model(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_hf_pretrained(tmp_path).eval()
    assert ours.config.rope_theta == 500000.0 and ours.config.rope_scaling["rope_type"] == "llama3"
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        assert (ours(ids).logits - hf(input_ids=ids).logits).abs().max() <= 1e-4
