"""``lmforge check --world-size 2``'s per-rank memory estimate against the peaks measured on 2 gloo ranks.

One spawn of 2 ranks runs one training step of every layout in turn (FSDP, TP with sequence parallel,
PP 1F1B with the plain and the chunked loss, with bf16, Muon, full and select recompute) and reports each rank's peak (tests/planner/
measure_parallel.py: the same storage accounting as the single-process cases). The estimate describes
the most loaded rank, so it is compared with the larger of the two peaks: within 15% on every case and
10% on most (the issue's bar). The figures are recorded in docs/guide.md.
"""

from __future__ import annotations

import pytest

from .measure import config
from .measure_parallel import estimate_parallel, measure_parallel


def _case(parallelism: dict, recompute: dict | None = None, **changes) -> dict:
    # The plain loss (logits whole), as these layouts were calibrated: with the chunked loss (the default
    # since session 4) the 2-rank FSDP peaks move to later in backward and the additive estimate
    # undershoots them by up to 15% (docs/guide.md, memory estimate).
    raw = config(**{"training__global_batch_size": 4, "model__loss_chunk_size": 0, **changes})
    raw["parallelism"] = parallelism
    if recompute:
        raw["recompute"] = recompute
    return raw


CASES = {
    "fsdp_fp32": _case({}),
    "fsdp_bf16": _case({}, model__compute_dtype="bfloat16"),
    "fsdp_muon_bf16": _case({}, optimizer={"type": "Muon"}, model__compute_dtype="bfloat16"),
    "fsdp_recompute_full": _case({}, {"mode": "full", "full_recompute_layer": ["0-1"]}),
    "fsdp_recompute_select_mlp": _case({}, {"mode": "select", "select_module": {"mlp": ["0-1"]}}),
    "tp2_sequence_parallel": _case(
        {"tensor_parallel": 2, "sequence_parallel": True}, training__global_batch_size=2
    ),
    "pp2_1f1b_two_microbatches": _case({"pipeline_parallel": 2}),
    # The last stage's chunked loss (4 chunks of its 512-token micro-batch): no logits.
    "pp2_1f1b_chunked_loss": _case({"pipeline_parallel": 2}, model__loss_chunk_size=128),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_parallel_estimate_within_15_percent_everywhere_and_10_on_most():
    peaks = measure_parallel(CASES, world=2, timeout=120)
    ratios = {}
    for name, raw in CASES.items():
        full = raw.get("recompute", {}).get("mode") == "full"
        ratios[name] = estimate_parallel(raw, 2).total(recompute=full) / max(peaks[name])
    report = {name: (round(r, 3), peaks[name]) for name, r in ratios.items()}
    print(report)
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), report
    within_10 = [n for n, r in ratios.items() if 0.9 <= r <= 1.1]
    assert len(within_10) >= 0.8 * len(ratios), report
