"""Exact resume: N steps straight == N/2 steps, SIGKILL, resume, the rest (bitwise, CPU, deterministic)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.train.callbacks import read_metrics

from .tiny_run import train_tiny

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    # Keep the caller's PYTHONPATH (a worktree's src/) after tests/, so the child imports the same lmforge.
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "train.tiny_run", str(tmp), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    train_tiny(tmp, STEPS)
    return tmp


def losses(tmp: Path) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(tmp / "run" / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill_and_resume_is_bitwise_exact(straight, tmp_path, async_save):
    extra = ["--async-save"] if async_save else []
    killed = run(tmp_path, str(STEPS), "--kill-after", "5", *extra)
    assert killed.returncode == -signal.SIGKILL
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert saved in (2, 4)  # an async save of step 4 may still have been in flight at the kill
    if not async_save:
        assert saved == 4
    trainer = train_tiny(tmp_path, STEPS, load=True, async_save=async_save)
    assert trainer.summary()["resumed from"] == str(tmp_path / "ckpt" / f"iteration_{saved:08d}")
    assert losses(tmp_path) == losses(straight)  # per-step loss and grad norm, bitwise (floats via repr)
    a = torch.load(straight / "final_weights.pt")
    b = torch.load(tmp_path / "final_weights.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_saves_at_end_of_step_and_exits_cleanly(tmp_path):
    r = run(tmp_path, str(STEPS), "--sigterm-after", "3", "--interval", "100")
    assert r.returncode == 0, r.stderr
    assert "received SIGTERM" in r.stderr
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"].startswith("stopped early") and summary["steps"] == f"3/{STEPS}"
