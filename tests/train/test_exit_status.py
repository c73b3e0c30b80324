"""``lmforge train``'s exit status says whether the run trained: 0 when it did, 5 (a run that could not train,
lmforge.errors.EXIT_TRAINING_FAILED) when none of its steps applied an update — never 0 "completed"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmforge.cli import main
from lmforge.errors import EXIT_TRAINING_FAILED
from lmforge.train.callbacks import read_metrics

from .test_train_cli import ADAMW, write_config

FAULTS = Path(__file__).resolve().parent / "recovery"  # faults.py: test-only callbacks named in a YAML


def fp32_config(tmp_path: Path, steps: int) -> str:
    cfg = write_config(tmp_path, ADAMW, steps=steps)
    raw = yaml.safe_load(Path(cfg).read_text())
    raw["model"]["compute_dtype"] = "float32"
    Path(cfg).write_text(yaml.safe_dump(raw))
    return cfg


@pytest.mark.slow
def test_a_run_that_applies_no_update_exits_5_with_the_reasons(tmp_path, monkeypatch, capsys):
    """(A run that trains exits 0: every CLI run of the suite checks it, e.g. test_train_cli_end_to_end.)"""
    monkeypatch.syspath_prepend(str(FAULTS))
    monkeypatch.setenv("LMFORGE_ALLOW_IMPORTS", "1")
    # 2 steps, fewer than the 10 skipped steps in a row that stop a run: before, this run "completed", exit 0.
    args = [
        "train",
        "--config",
        fp32_config(tmp_path, steps=2),
        "--set",
        "callbacks=[{type: faults.NonFiniteWeights}]",
    ]
    code = main(args)
    err = capsys.readouterr().err
    assert code == EXIT_TRAINING_FAILED == 5, err  # docs/training.md "Exit statuses": not 0, not input's 2
    (message,) = [
        line for line in err.splitlines() if line.startswith("lmforge train: error: ")
    ]  # one paragraph
    assert "Training applied no update: all 2 step(s) this run took (steps 1..2) were skipped" in message
    assert (
        "(2 non-finite loss; the last: loss is nan), so the model's weights are the ones it started from."
        in message
    )
    assert "fewer steps than the 10 skipped steps in a row" in message
    assert "Lower lr_scheduler.learning_rate" in message
    assert "Traceback" not in err
    assert all(r["skipped"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed: no update applied: all 2 step(s) skipped"
    assert summary["skipped steps (this run)"] == "2 of 2 (2 non-finite loss)"
    # The NaN weights were not saved (CheckpointManager refuses non-finite weights), so no checkpoint is named.
    assert summary["checkpoints"] == "-" and "checkpoints it saved" not in message
