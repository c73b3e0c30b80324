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
    # torchrun restarted the job after a worker failed, and says which one it saw first: the hung rank's
    # watchdog (status 3), or rank 0, whose watchdog or collective ends it within a watchdog tick of the
    # same timeout. When both have exited by the same poll, it reports rank 0 whatever rank 1's status
    # (seen once under the AVX2 imitation, with a status other than 1 or 3 that the log did not keep), so
    # the hung rank's own status is tested alone (test_units.py::test_a_stalled_rank_exits_with_status_3...).
    failures = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: ([01])", log)
    assert failures and all(int(code) != 0 for code, _ in failures), "\n".join(
        line for line in log.splitlines() if "exitcode" in line or "error" in line.lower()
    )
    assert "elastic restart 1: resuming from the latest complete checkpoint" in log and "(iteration 4)" in log
    assert [s for s, _ in losses(tmp_path)] == list(range(1, 9))
