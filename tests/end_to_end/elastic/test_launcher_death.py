"""Workers never outlive their launcher (torchrun starts them in sessions of their own, so a SIGKILL
to the launcher's process group does not reach them): lmforge.utils.launcher_death."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.errors import LmforgeError
from lmforge.utils import launcher_death

from .helpers import TESTS_DIR, job_config, kill_group, losses, worker_env
from .test_launch_scripts import LAUNCHER, REPO, free_port, launcher_env

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@linux_only
@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_to_the_launchers_group_stops_the_workers_with_one_save(tmp_path):
    cfg = job_config(tmp_path, steps=10_000, checkpoint={"save_interleaved_steps": 100_000})
    env = launcher_env(NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
    log = tmp_path / "job.log"  # a file, not a pipe: the orphans would hold a pipe open
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(LAUNCHER), "train", "--config", cfg],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(losses(tmp_path)) < 3:
            ended = proc.poll() is not None or time.monotonic() > deadline
            assert not ended, f"training did not start:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        workers = [w for torchrun in children(proc.pid) for w in children(torchrun)]
        assert len(workers) == 2, workers
        kill_group(proc)  # the script and torchrun, at once; the workers are in sessions of their own
        proc.wait()
        killed = time.monotonic()
        while any(running(w) for w in workers) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        gone_after = time.monotonic() - killed
    finally:
        kill_group(proc)
        for w in workers:  # whatever happened, this test leaves no orphans
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)
    text = log.read_text()
    assert gone_after < 60, text[-3000:]
    # They stopped as on SIGTERM: at one agreed step, with one complete checkpoint of it.
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("iteration_*"))
    last_step = losses(tmp_path)[-1][0]
    assert saved == [f"iteration_{last_step:08d}"], (saved, last_step, text[-3000:])
    assert len(list((tmp_path / "ckpt" / saved[0]).glob("*.distcp"))) == 2
    assert text.count("Saved checkpoint of step") == 1 and "received SIGTERM" in text


@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("mode", ["prctl", "poll"])  # poll: without prctl, as off Linux
def test_an_orphan_that_ignores_sigterm_exits_after_the_grace_period(tmp_path, mode):
    proc = subprocess.run(
        [sys.executable, "-m", "end_to_end.elastic.orphan_run", "reaper", str(tmp_path), mode],
        cwd=TESTS_DIR,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # The launcher's death sent SIGTERM; the worker ignored it and was ended 1 s later.
    assert result["sigterm"] and result["status"] == launcher_death.EXIT_ORPHANED, (result, proc.stderr)
    assert 1.0 <= result["seconds"] < 20, result
    assert "its launcher" in proc.stderr and "LMFORGE_ORPHAN_GRACE_S" in proc.stderr


def test_nothing_is_armed_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launcher_death.end_with_launcher() is False


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_grace_period_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(launcher_death.GRACE_ENV, value)
    with pytest.raises(LmforgeError, match="LMFORGE_ORPHAN_GRACE_S=.*a number >= 0"):
        launcher_death.grace_seconds()


def test_the_grace_period_defaults_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(launcher_death.GRACE_ENV, raising=False)
    assert launcher_death.grace_seconds() == launcher_death.DEFAULT_GRACE_S
    monkeypatch.setenv(launcher_death.GRACE_ENV, "2.5")
    assert launcher_death.grace_seconds() == 2.5
