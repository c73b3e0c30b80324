"""fp16 compute with dynamic loss scaling on parallel layouts: FSDP (the reduced gradients carry the
scale) and pipeline parallel (the schedule's own backward must apply the step's scale) reproduce the
single-process fp32 losses and gradient norms within fp16 precision. A scale not applied in backward,
or not divided out, moves the gradient norm by the scale itself (2^16)."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import validate_section

from .harness import INIT_SEED, make_data, reference_run, run_workers, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, SEQ, GBS = 2, 16, 4
TOL = {"loss": 5e-3, "grad_norm": 3e-2}  # fp16's epsilon is 9.8e-4


@pytest.mark.timeout(200)
def test_fp16_layouts_match_the_fp32_single_process_run(tmp_path):
    from lmforge.models import build_model

    fp32, fp16 = tiny_llama(), tiny_llama(compute_dtype="float16")
    torch.manual_seed(0)
    state = {
        k: v.detach().clone()
        for k, v in build_model(validate_section("model", fp32), seed=INIT_SEED).state_dict().items()
    }
    data = make_data(STEPS, GBS, SEQ, fp32["vocab_size"])
    ref = reference_run(fp32, state, data, 1)
    torch.save(state, tmp_path / "state.pt")
    torch.save(data, tmp_path / "data.pt")
    layouts = {"fsdp_fp16": {}, "pp_fp16": {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"}}
    cases = [
        {
            "name": name,
            "model": fp16,
            "parallelism": par,
            "optimizer": None,
            "state": str(tmp_path / "state.pt"),
            "data": str(tmp_path / "data.pt"),
        }
        for name, par in layouts.items()
    ]
    results = run_workers(2, {"task": "train_task", "cases": cases, "gbs": GBS, "lbs": 1}, timeout=170)
    failures = []
    for name in layouts:
        for rank, res in enumerate(results):
            for key, rel in TOL.items():
                for step, (a, b) in enumerate(zip(res[name][key], ref[key])):
                    if not math.isclose(a, b, rel_tol=rel):
                        failures.append(
                            f"{name} rank {rank} {key} step {step}: {a} vs fp32 single-process {b}"
                        )
    assert not failures, "\n".join(failures)
