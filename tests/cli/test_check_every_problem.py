"""`lmforge check` names every problem of a file in one run, each with its key, across the layers of
loading (fields, checks that need another section, the run plan) — not one layer per attempt.

The reference for each problem is the message `check` gives when that problem is the only one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.cli.check_problems import split_problems

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")

# Each breaks a different layer: a field, a check needing training.steps (the lr schedule), a check
# across model fields, the run plan (world size), and a misspelt key.
MISTAKES = {
    "training.steps": "training.steps=-1",
    "lr_scheduler.warmup_steps": "lr_scheduler.warmup_steps=-3",
    "model.num_attention_heads": "model.num_attention_heads=5",
    "parallelism.tensor_parallel": "parallelism.tensor_parallel=3",
    "training.global_batch_sze": "training.global_batch_sze=4",
}


def _check_in_process(capsys, *sets: str) -> tuple[int, str]:
    argv = ["check", "--config", DEMO]
    for item in sets:
        argv += ["--set", item]
    status = main(argv)
    return status, capsys.readouterr().err


def _check(*sets: str) -> tuple[int, str]:
    argv = [sys.executable, "-m", "lmforge", "check", "--config", DEMO]
    for item in sets:
        argv += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, cwd=REPO)
    return proc.returncode, proc.stderr


def _problems(stderr: str) -> list[str]:
    text = stderr.strip().removeprefix("lmforge check: error: ")
    return split_problems(text)


@pytest.mark.slow
def test_every_problem_at_once_each_with_its_key(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    alone = {}
    for key, item in MISTAKES.items():
        status, err = _check_in_process(capsys, item)
        assert status == 2 and "Traceback" not in err
        (alone[key],) = _problems(err)
        assert key in alone[key]
    status, err = _check(*MISTAKES.values())
    assert status == 2 and "Traceback" not in err
    together = _problems(err)
    assert sorted(together) == sorted(alone.values())


def test_split_problems_reads_the_numbered_form():
    text = "Invalid configuration in a.yaml, 3 problems: (1) x.y: bad; really; (2) b (2); (3) c."
    assert split_problems(text) == ["x.y: bad; really", "b (2)", "c."]
    assert split_problems("Invalid configuration in a.yaml: one thing") == ["one thing"]
