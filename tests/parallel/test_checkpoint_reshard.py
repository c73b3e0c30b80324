"""A checkpoint saved on 2 ranks (tensor parallel) resumes on 1 rank and on 4 (pipeline × FSDP).

The trainer's DCP checkpoints store every tensor under its global name and shape, whatever the layout
that wrote it; each resumed run must continue with the loss the uninterrupted single-process run has
at that step (fp32, 1e-5 relative: a mis-sharded weight or lost optimizer state moves it by >1e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import validate_section

from .harness import INIT_SEED, checkpoint_task, make_data, reference_run, run_workers, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(200)]

STEPS, GBS, SEQ, SAVE_AT = 4, 4, 16, 2  # the step after the first resumed one depends on the optimizer state


def test_checkpoint_from_two_ranks_resumes_on_one_and_four(tmp_path):
    from lmforge.models import build_model

    section = tiny_llama()
    torch.manual_seed(0)
    model = build_model(validate_section("model", section), seed=INIT_SEED)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = make_data(STEPS, GBS, SEQ, section["vocab_size"])
    ref = reference_run(section, state, data, 1)["loss"]
    torch.save(state, tmp_path / "state.pt")
    torch.save(data, tmp_path / "data.pt")
    common = {
        "model": section,
        "state": str(tmp_path / "state.pt"),
        "data": str(tmp_path / "data.pt"),
        "gbs": GBS,
        "lbs": 1,
    }
    save = {
        **common,
        "task": "checkpoint_task",
        "parallelism": {"tensor_parallel": 2},
        "save_path": str(tmp_path / "ckpt"),
        "save_at": SAVE_AT,
    }
    saved = run_workers(2, save)
    resume = {**common, "resume": str(tmp_path / "ckpt")}
    one = checkpoint_task(0, 1, resume)  # in this process: no process group at all
    four = run_workers(4, {**resume, "task": "checkpoint_task", "parallelism": {"pipeline_parallel": 2}})
    runs = {
        "2 ranks (tp=2)": saved[0]["loss"],
        "resumed on 1 rank": one["loss"],
        "resumed on 4 ranks (pp=2 x fsdp=2)": four[0]["loss"],
    }
    for name, losses in runs.items():
        for step, loss in losses.items():
            assert math.isclose(loss, ref[int(step)], rel_tol=1e-5), (
                f"{name} step {step}: {loss} vs {ref[int(step)]}"
            )
    assert set(map(int, runs["resumed on 1 rank"])) == {SAVE_AT, SAVE_AT + 1}
