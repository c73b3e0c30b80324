"""Elastic restarts (issue 19): SIGKILL a worker mid-run and mid-save under torchrun --max-restarts;
the job resumes on its own from the newest complete checkpoint (no YAML edit) and ends bitwise equal
to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from .helpers import checkpoint_weights, finish, job_config, losses, start_standalone


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_workers_restart_and_resume_bitwise(tmp_path):
    steps = 8
    clean = tmp_path / "clean"
    reference = start_standalone(job_config(clean, steps))  # runs beside the faulty job

    # Attempt 0: rank 0 is SIGKILLed after step 5 (newest checkpoint: 4). Attempt 1: rank 1 is
    # SIGKILLed inside the save of step 6, after writing its shard (newest complete: still 4).
    # Attempt 2 runs clean. Rank 0 first: its death is what left the stale store keys (the hang).
    faults = [
        {"kind": "kill", "step": 5, "rank": 0, "attempt": 0},
        {"kind": "kill_mid_save", "step": 6, "rank": 1, "attempt": 1},
    ]
    faulty = tmp_path / "faulty"
    rc, log = finish(start_standalone(job_config(faulty, steps, faults), max_restarts=2))
    assert rc == 0, log[-4000:]
    rc, clean_log = finish(reference)
    assert rc == 0, clean_log[-4000:]
    assert log.count("elastic restart 1: resuming from the latest complete checkpoint") >= 1, log[-3000:]
    assert "elastic restart 2: resuming" in log and "(iteration 4)" in log
    assert "Resumed from" in log and "iteration_00000004 at step 4" in log

    assert losses(faulty) == losses(clean)  # every step once, floats compared exactly
    assert [s for s, _ in losses(clean)] == list(range(1, steps + 1))
    final = f"iteration_{steps:08d}"
    a = checkpoint_weights(clean / "ckpt" / final, tmp_path)
    b = checkpoint_weights(faulty / "ckpt" / final, tmp_path)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name
