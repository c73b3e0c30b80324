"""The first pipelined step leaves the same buffers as one process: MoE token counts and max logits.

``torch.distributed.pipelining`` infers the stages' shapes at the first step by running each stage
once more (past the first stage on uninitialised activations). Those runs must not count routed
tokens (the aux-loss-free expert bias is updated from the counts) nor raise the tracked max logits
(QK-Clip clips from them). Two ranks, Qwen3-MoE with one MoE layer per stage, 1F1B: after one step
every buffer equals the single-process run's over the same micro-batches (counts exactly; max logits
within fp32 rounding), and the step logs the same balancing loss. The stages and the pruned model
carry no method bound to a live module.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config import validate_section

from .harness import INIT_SEED, make_data, micro_batches, run_workers, tiny_qwen3_moe

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(200)]

GBS, SEQ = 4, 16


def test_first_pipelined_step_counts_tokens_and_max_logits_like_one_process(tmp_path):
    from lmforge.models import build_model

    section = tiny_qwen3_moe()
    data = make_data(1, GBS, SEQ, section["vocab_size"])
    torch.save(data, tmp_path / "data.pt")
    reference = build_model(validate_section("model", section), seed=INIT_SEED)
    reference.track_max_logits = True
    balancing = []
    for batch in micro_batches(data, 0, list(range(GBS)), 1):
        out = reference(**batch)
        out.loss.backward()
        balancing.append(float(out.aux_losses["load_balancing_loss"].detach()))
    expected = {
        name: buf
        for name, buf in reference.named_buffers()
        if name.endswith(("tokens_per_expert", "max_logits"))
    }
    spec = {
        "task": "buffers_task",
        "model": section,
        "parallelism": {"pipeline_parallel": 2},
        "data": str(tmp_path / "data.pt"),
        "gbs": GBS,
        "lbs": 1,
    }
    results = run_workers(2, spec)
    seen = set()
    for rank, got in enumerate(results):
        assert got.pop("bound_methods") == [], f"rank {rank}: methods bound to live modules"
        # The step's logged balancing loss: every stage's layers, averaged over micro-batches.
        reported = got.pop("aux_losses")["load_balancing_loss"]
        assert reported == pytest.approx(sum(balancing) / len(balancing), rel=1e-5)
        got = {k: v for k, v in got.items() if k != "ok"}
        assert got, f"rank {rank} holds no MoE layer"
        for name, values in got.items():
            seen.add(name)
            if name.endswith("tokens_per_expert"):
                assert values == expected[name].tolist(), (
                    f"rank {rank} {name}: {values} vs {expected[name].tolist()}"
                )
            else:
                torch.testing.assert_close(torch.tensor(values), expected[name], rtol=1e-5, atol=1e-6)
    assert seen == set(expected), sorted(set(expected) ^ seen)
