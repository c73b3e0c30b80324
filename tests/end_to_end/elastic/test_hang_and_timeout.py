"""A rank that hangs makes the job exit within parallelism.process_group_timeout with a message
naming the rank and its phase; torchrun then restarts the job, which resumes and completes."""

from __future__ import annotations

import re

import pytest

from .helpers import finish, job_config, losses, start_standalone

TIMEOUT_S = 15  # above the first step's warm-up on a busy 2-core machine


@pytest.mark.slow
@pytest.mark.distributed
def test_hung_rank_is_named_and_the_restart_resumes(tmp_path):
    faults = [{"kind": "hang", "step": 5, "rank": 1, "attempt": 0}]
    cfg = job_config(tmp_path, 8, faults, parallelism={"process_group_timeout": TIMEOUT_S})
    rc, log = finish(start_standalone(cfg, max_restarts=1), timeout=300)
    assert rc == 0, log[-4000:]
    # The hung rank names itself; rank 0, which only waited for it, names rank 1 and where it hangs.
    stuck = "in phase 'after step 5: callbacks (logging, evaluation, checkpoint save)'"
    assert re.search(
        rf"rank 1 made no progress for \d+ s \(parallelism.process_group_timeout = {TIMEOUT_S} s\) {re.escape(stuck)}",
        log,
    ), log[-4000:]
    assert "It was waiting for rank 1 in 'after step 5: callbacks" in log, log[-4000:]
    # torchrun reports the first worker to exit: the hung rank's watchdog (exit status 3) or rank 0, whose
    # collective times out after the same process_group_timeout (status 1); which comes first is a race.
    assert re.search(r"failed \(exitcode: [13]\) local_rank: [01]", log), log[-4000:]
    assert "elastic restart 1: resuming from the latest complete checkpoint" in log and "(iteration 4)" in log
    assert [s for s, _ in losses(tmp_path)] == list(range(1, 9))
