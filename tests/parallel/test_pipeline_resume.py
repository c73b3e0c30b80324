"""A pipeline-parallel run resumed from its own checkpoint continues bit for bit.

Two ranks, interleaved 1F1B with two chunks per rank and tied word embeddings (the weight lives on
the first stage and reaches the last one each step), lmforge's AdamW (decay and no-decay groups, which
the two stages list in different orders): the run saves after step 2 and goes on; a second run on the
same layout resumes from that checkpoint. Its losses at steps 2 and 3 must equal the uninterrupted
run's exactly (same layout, same summation order: any state lost or restored differently, such as the
optimizer's moments of the tied weight or a group's weight decay, changes them), and match the
single-process reference within the parity tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import validate_section

from .harness import INIT_SEED, make_data, reference_run, run_workers, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(200)]

STEPS, GBS, SEQ, SAVE_AT = 4, 4, 16, 2
ADAMW = {"type": "AdamW", "weight_decay": 0.01}
PIPELINE = {
    "pipeline_parallel": 2,
    "pipeline_parallel_schedule": "interleaved_1f1b",
    "pipeline_parallel_interleave_num": 2,
}


def test_pipeline_run_resumes_bit_for_bit(tmp_path):
    from lmforge.models import build_model

    section = tiny_llama(tie_word_embeddings=True)
    torch.manual_seed(0)
    state = {
        k: v.detach().clone()
        for k, v in build_model(validate_section("model", section), seed=INIT_SEED).state_dict().items()
    }
    data = make_data(STEPS, GBS, SEQ, section["vocab_size"])
    ref = reference_run(section, state, data, 1, ADAMW)["loss"]
    torch.save(state, tmp_path / "state.pt")
    torch.save(data, tmp_path / "data.pt")
    common = {
        "task": "checkpoint_task",
        "model": section,
        "parallelism": PIPELINE,
        "optimizer": ADAMW,
        "state": str(tmp_path / "state.pt"),
        "data": str(tmp_path / "data.pt"),
        "gbs": GBS,
        "lbs": 1,
    }
    saved = run_workers(2, {**common, "save_path": str(tmp_path / "ckpt"), "save_at": SAVE_AT})
    resumed = run_workers(2, {**common, "resume": str(tmp_path / "ckpt")})
    for rank in range(2):
        whole, cont = saved[rank]["loss"], resumed[rank]["loss"]
        assert sorted(map(int, cont)) == [SAVE_AT, SAVE_AT + 1]
        for step, loss in cont.items():
            assert loss == whole[step], (
                f"rank {rank} step {step}: resumed {loss!r} vs uninterrupted {whole[step]!r}"
            )
        for step, loss in whole.items():
            assert math.isclose(loss, ref[int(step)], rel_tol=1e-5), (
                f"step {step}: {loss} vs {ref[int(step)]}"
            )
