"""The MoE monitor's tokens per expert do not depend on the layout.

Under tensor (sequence) parallel each rank routes only its shard of the sequence; the monitor sums the
counts over the ranks that route different tokens of the same layers (the expert-bias group), so every
rank writes what one process writes. (Before: each tp rank wrote its own shard's counts.)
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config import validate_section

from .harness import INIT_SEED, moe_monitor_records, run_workers, tiny_qwen3_moe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_tokens_per_expert_under_tensor_parallel_equal_one_process(tmp_path):
    from lmforge.models import build_model

    section = tiny_qwen3_moe()
    ids = torch.randint(0, section["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(5))
    reference = moe_monitor_records(
        build_model(validate_section("model", section), seed=INIT_SEED), ids, str(tmp_path / "one.jsonl")
    )
    assert len(reference) == 2 * 2  # two micro-batches, two MoE layers
    assert all(sum(r["tpe"]) == 16 * section["num_experts_per_tok"] for r in reference)
    spec = {
        "task": "moe_monitor_task",
        "model": section,
        "parallelism": {"tensor_parallel": 2},
        "gbs": 1,
        "lbs": 1,
        "ids": ids.tolist(),
    }
    for rank, result in enumerate(run_workers(2, spec, timeout=90)):
        assert result["records"] == reference, f"rank {rank}"
