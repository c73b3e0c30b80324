"""Launch: torchrun's variables are checked with clear errors, and an error only one rank finds is
reported once while the other ranks stop quietly (no transport tracebacks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from end_to_end.elastic.helpers import finish, job_config, start_standalone
from lmforge.utils.run_lock import RunLock

REPO = Path(__file__).resolve().parents[3]

BAD_ENVS = {
    "RANK=abc": ({"RANK": "abc"}, "RANK='abc' must be an integer >= 0"),
    "WORLD_SIZE without MASTER_ADDR": ({"WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not set"),
    "WORLD_SIZE without MASTER_PORT": ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
    "MASTER_PORT out of range": ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 must be a TCP port"),
    "LOCAL_RANK beyond LOCAL_WORLD_SIZE": ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3 must be below LOCAL_WORLD_SIZE=2"),
}  # fmt: skip


def _lmforge(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    clean.update(PYTHONPATH=str(REPO / "src"), **env)
    return subprocess.run(
        [sys.executable, "-m", "lmforge", *argv], env=clean, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD_ENVS))
def test_env_refuses_a_bad_launch_environment(name):
    env, needle = BAD_ENVS[name]
    done = _lmforge("env", "--no-collective", env=env)
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
def test_train_refuses_world_size_without_master_addr_before_anything(tmp_path):
    cfg = job_config(tmp_path, steps=2)
    done = _lmforge("train", "--config", cfg, env={"WORLD_SIZE": "2"})
    assert done.returncode == 2 and "MASTER_ADDR and MASTER_PORT are not set" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_error_only_rank_0_finds_is_reported_once_and_the_others_stop_quietly(tmp_path):
    cfg = job_config(tmp_path, steps=2)
    (tmp_path / "run").mkdir()
    lock = RunLock(tmp_path / "run", "output_dir").acquire()  # another live run holds the output_dir
    try:
        code, out = finish(start_standalone(cfg, nproc=2), timeout=240)
    finally:
        lock.release()
    assert code != 0 and code != -999, out
    assert out.count("lmforge train: error:") == 1 and "is in use by another lmforge run" in out, out
    assert "exitcode  : 2" in out, out  # the reporting rank ended as on a user error (torchrun's summary)
    # No worker traceback (torchrun's own summary of the failed workers is the launcher's, not ours).
    for noise in ("src/lmforge", "Connection closed by peer", "Connection reset", "gloo"):
        assert noise not in out, out
