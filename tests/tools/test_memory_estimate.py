"""``lmforge check``'s memory estimate against the measured peak of real CPU training steps.

Each case builds the model, optimizer and training step the trainer uses, runs one full step
(forward, backward, clipping, optimizer) under a storage-counting dispatch mode (tests/tools/
measure.py) and compares the peak with ``estimate_memory`` (the code ``check`` prints): within 15% on
every case and 10% on most (the issue's bar). The figures are recorded in docs/guide.md.
"""

from __future__ import annotations

import copy

import pytest
import torch

from .measure import BASE, config, estimate, measure

MOE = {
    **BASE["model"],
    "model_type": "qwen3_moe",
    "architectures": "Qwen3MoeForCausalLM",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
}
LLAMA = {
    **BASE["model"],
    "model_type": "llama",
    "architectures": "LlamaForCausalLM",
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "seq_length": 128,
    "vocab_size": 3000,
}
FULL = {"mode": "full", "full_recompute_layer": ["0-1"]}
SELECT_ATTENTION = {"mode": "select", "select_module": {"self_attention": ["0-1"]}}
SELECT_MLP = {"mode": "select", "select_module": {"mlp": ["0-1"]}}


def _seq(n: int) -> dict:
    return {"model__seq_length": n, "model__max_position_embeddings": n}


CASES = {
    "adamw_fp32": config(),
    "adamw_bf16": config(model__compute_dtype="bfloat16"),
    "muon_bf16": config(optimizer={"type": "Muon"}, model__compute_dtype="bfloat16"),
    "recompute_full": {**config(), "recompute": FULL},
    "recompute_full_bf16_seq512": {**config(model__compute_dtype="bfloat16", **_seq(512)), "recompute": FULL},
    "muon_seq512_accumulation2": config(
        optimizer={"type": "Muon"}, training__global_batch_size=4, **_seq(512)
    ),
    "recompute_select_attention": {**config(), "recompute": SELECT_ATTENTION},
    "recompute_select_mlp": {**config(), "recompute": SELECT_MLP},
    "recompute_select_attention_bf16_seq512": {
        **config(model__compute_dtype="bfloat16", **_seq(512)),
        "recompute": SELECT_ATTENTION,
    },
    "offload_states_fp32": config(optimizer={"type": "AdamW", "offload_states": True}),
    "offload_states_bf16": config(
        optimizer={"type": "AdamW", "offload_states": True}, model__compute_dtype="bfloat16"
    ),
    "seq64": config(**_seq(64)),
    "moe_bf16_top2": config(model={**MOE, "compute_dtype": "bfloat16"}),
    "tied_large_vocab": config(
        model__tie_word_embeddings=True, model__vocab_size=8192, model__hidden_size=128, model__head_dim=32
    ),
    "llama_other_shape": config(model=LLAMA, training__local_batch_size=4, training__global_batch_size=4),
}


@pytest.fixture(scope="module")
def ratios():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, raw in CASES.items():
            est = estimate(raw).total(recompute=raw.get("recompute", {}).get("mode") == "full")
            out[name] = est / measure(raw)
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_estimate_within_15_percent_everywhere_and_10_on_most(ratios):
    report = {name: round(r, 3) for name, r in ratios.items()}
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), report
    within_10 = [n for n, r in ratios.items() if 0.9 <= r <= 1.1]
    assert len(within_10) >= 0.8 * len(ratios), report


def test_state_compression_is_counted():
    raw = config()
    from lmforge.config import load_config
    from lmforge.models import build_model, build_model_config
    from lmforge.parallel import ParallelDims
    from lmforge.tools.memory import estimate_memory

    cfg = load_config(raw)
    mc = build_model_config(cfg.model)
    net = build_model(cfg.model, device="meta")
    dims = ParallelDims.from_section(cfg.parallelism, 1)
    kw = dict(
        compute_dtype=torch.float32,
        optimizer_type="AdamW",
        seq_length=mc.seq_length,
        local_batch_size=2,
        hidden_size=mc.hidden_size,
        num_layers=mc.num_layers,
        vocab_size=mc.vocab_size,
    )
    fp32 = estimate_memory(net, dims, **kw)
    bf16 = estimate_memory(net, dims, moment_bytes=2, **kw)
    n = sum(p.numel() for p in net.parameters())
    assert fp32.optimizer_states == 8 * n and bf16.optimizer_states == 4 * n


def test_a_missing_model_fact_is_an_error_not_a_guess():
    """The activation estimate reads the typed TransformerConfig: a model without one, or a family that
    leaves a dimension unset (0), is refused (the estimate used to fill in 4·hidden, hidden/64 heads...)."""
    import dataclasses

    import pytest

    from lmforge.config import load_config
    from lmforge.models import build_model_config
    from lmforge.tools.memory import layer_activation_bytes_per_token

    mc = build_model_config(load_config(config()).model)
    assert layer_activation_bytes_per_token(mc, mc.hidden_size, 4) > 0
    with pytest.raises(
        ValueError, match="needs num_key_value_heads, intermediate_size of its TransformerConfig"
    ):
        layer_activation_bytes_per_token(
            dataclasses.replace(mc, num_key_value_heads=0, intermediate_size=0), mc.hidden_size, 4
        )
    with pytest.raises(TypeError, match="needs an lmforge model with a TransformerConfig"):
        layer_activation_bytes_per_token(None, mc.hidden_size, 4)


def test_one_rank_end_of_backward_counts_the_units_16_bit_gradients():
    """With activations small next to the parameters the peak is the end of backward: at one rank in bf16
    a small model is one FSDP unit (parallel/fsdp.py), whose bf16 gradients are alive while they are
    turned into the fp32 ones (the compute copies already freed). Without that term the estimate is ~11%
    low here; counting the compute copies as well would make it ~11% high."""
    raw = config(model__compute_dtype="bfloat16", model__num_hidden_layers=4, **_seq(16))
    est = estimate(raw)
    assert est.unit_gradients == 2 * est.local_parameter_count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ratio = est.total() / measure(raw)
    finally:
        torch.set_num_threads(threads)
    assert 0.95 <= ratio <= 1.05, ratio


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["adamw_bf16", "muon_bf16", "moe_bf16_top2", "recompute_select_attention_bf16_seq512"]
)
def test_16_bit_matmuls_left_uncomputed_change_no_peak(name):
    """The measurement allocates the 16-bit matrix products' outputs without computing them (so the bf16
    cases cost nothing on a CPU that emulates bf16): the peak is the same bytes as computing them."""
    raw = copy.deepcopy(CASES[name])
    raw["model"] = {
        **raw["model"],
        "seq_length": 64,
        "max_position_embeddings": 64,
    }  # same code path, cheaper
    assert measure(raw) == measure(raw, compute_16bit_matmuls=True)
