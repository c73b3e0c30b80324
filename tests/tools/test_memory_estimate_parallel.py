"""``lmforge check --world-size 2``'s per-rank memory estimate against the peaks measured on 2 gloo ranks.

One spawn of 2 ranks runs one training step of every layout in turn (FSDP, TP with sequence parallel,
PP 1F1B, with bf16, Muon, full and select recompute) and reports each rank's peak (tests/tools/
measure_parallel.py: the same storage accounting as the single-process cases). The estimate describes
the most loaded rank, so it is compared with the larger of the two peaks: within 15% on every case and
10% on most (the issue's bar). Every layout runs twice: with the chunked loss (``model.loss_chunk_size``,
512 by default), whose peak is the last layer's MLP backward on the FSDP layouts, and with the plain loss
(``loss_chunk_size: 0``, full logits), whose peak is the start of the loss backward. The figures are
recorded in docs/guide.md.
"""

from __future__ import annotations

import pytest

from .measure import config
from .measure_parallel import estimate_parallel, measure_parallel


def _case(parallelism: dict, recompute: dict | None = None, **changes) -> dict:
    raw = config(**{"training__global_batch_size": 4, **changes})
    raw["parallelism"] = parallelism
    if recompute:
        raw["recompute"] = recompute
    return raw


def _plain(raw: dict) -> dict:
    """The same case with the plain loss (the logits whole)."""
    return {**raw, "model": {**raw["model"], "loss_chunk_size": 0}}


CHUNKED = {
    "fsdp_fp32": _case({}),
    "fsdp_bf16": _case({}, model__compute_dtype="bfloat16"),
    "fsdp_muon_bf16": _case({}, optimizer={"type": "Muon"}, model__compute_dtype="bfloat16"),
    "fsdp_recompute_full": _case({}, {"mode": "full", "full_recompute_layer": ["0-1"]}),
    "fsdp_recompute_select_mlp": _case({}, {"mode": "select", "select_module": {"mlp": ["0-1"]}}),
    "tp2_sequence_parallel": _case(
        {"tensor_parallel": 2, "sequence_parallel": True}, training__global_batch_size=2
    ),
    "pp2_1f1b_two_microbatches": _case({"pipeline_parallel": 2}),
}
PLAIN = {f"{name}_plain_loss": _plain(raw) for name, raw in CHUNKED.items()}
# A shape the MLP-backward moment was not read from, where it decides the estimate (the start of backward
# alone gave 0.947): an MLP 8x the hidden size.
CHUNKED["fsdp_fp32_wide_mlp"] = _case({}, model__intermediate_size=2048)
CASES = {**CHUNKED, **PLAIN}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("cases", [CHUNKED, PLAIN], ids=["chunked_loss", "plain_loss"])
def test_parallel_estimate_within_15_percent_everywhere_and_10_on_most(cases):
    peaks = measure_parallel(cases, world=2, timeout=120)
    ratios = {}
    for name, raw in cases.items():
        full = raw.get("recompute", {}).get("mode") == "full"
        ratios[name] = estimate_parallel(raw, 2).total(recompute=full) / max(peaks[name])
    report = {name: (round(r, 3), peaks[name]) for name, r in ratios.items()}
    print(report)
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), report
    within_10 = [n for n, r in ratios.items() if 0.9 <= r <= 1.1]
    assert len(within_10) >= 0.8 * len(ratios), report
