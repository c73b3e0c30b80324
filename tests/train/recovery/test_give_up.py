"""A give-up is final: the run that gives up leaves ``save_path/recovery_gave_up.json``, the same command again
(what ``torchrun --max-restarts`` does) is refused before anything is built, and a deliberate continuation —
the marker deleted, the settings changed — resumes and trains (world size 1, through the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmforge.cli import main
from lmforge.errors import EXIT_TRAINING_FAILED
from lmforge.train.callbacks import read_metrics
from lmforge.train.recovery.give_up import MARKER_FILE

from ..test_train_cli import ADAMW, write_config

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # trains the tiny model three times


def give_up_config(tmp_path: Path) -> str:
    """6 steps, a checkpoint every 2, one rollback allowed; the final norm x50 after update 4, twice: the spike
    at step 5 is rolled back to step 2, replayed, seen again and given up."""
    cfg = write_config(tmp_path, ADAMW, steps=6)
    raw = yaml.safe_load(Path(cfg).read_text())
    raw["model"]["compute_dtype"] = "float32"
    raw["checkpoint"].update({"save_interleaved_steps": 2, "save_max": 5})
    raw["recovery"] = {"enable": True, "data": "replay", "max_rollbacks": 1}
    raw["callbacks"] = [{"type": "faults.DamageNorm", "step": 4, "times": 2}]
    Path(cfg).write_text(yaml.safe_dump(raw))
    return cfg


def not_built(*args, **kwargs):
    raise AssertionError("the model was built")


def test_a_give_up_is_final_until_the_marker_is_deleted(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("LMFORGE_ALLOW_IMPORTS", "1")
    cfg = give_up_config(tmp_path)
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    assert main(["train", "--config", cfg]) == EXIT_TRAINING_FAILED
    err = capsys.readouterr().err
    marker_file = ckpt / MARKER_FILE
    assert f"{marker_file} records this give-up" in err
    marker = json.loads(marker_file.read_text())
    assert (marker["event"], marker["step"], marker["onset"], marker["rollbacks"]) == ("give_up", 5, 5, 1)
    assert (
        marker["anomaly"].startswith("loss spike")
        and "recovery.max_rollbacks (1) is reached" in marker["reason"]
    )
    assert marker["safe_checkpoint"] == str(ckpt / "iteration_00000002")
    assert (
        json.loads((run / "summary.json").read_text())["status"]
        == "stopped: recovery could not repair the run"
    )
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0  # says so too
    assert "recovery gave up at step 5 (loss spike" in capsys.readouterr().out
    assert main(["check", "--config", cfg]) == 0  # the file is valid; check warns of what train will refuse
    assert f"{marker_file} says that recovery gave up" in capsys.readouterr().out

    # The same command again (a torchrun restart): refused with the marker's story, before anything is built.
    monkeypatch.setattr("lmforge.train.builder._build_model", not_built)
    log_before = (run / "train.log").read_text()
    assert main(["train", "--config", cfg]) == EXIT_TRAINING_FAILED
    (message,) = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("lmforge train: error")
    ]
    assert (
        f"{marker_file} says that recovery gave up on the run in checkpoint.save_path at step 5: loss spike"
        in message
    )
    assert (
        f"then delete {marker_file} (an automatic resume then continues from {ckpt / 'iteration_00000002'})"
        in message
    )
    assert (run / "train.log").read_text() == log_before  # not even the run directory was opened
    monkeypatch.undo()

    # Deliberately: the cause removed (the fault), more rollbacks allowed, the marker deleted: the run resumes
    # from the newest safe checkpoint and trains to the end.
    marker_file.unlink()
    fixed = [
        "--set",
        "callbacks=[]",
        "--set",
        "recovery.max_rollbacks=2",
        "--set",
        "checkpoint.auto_resume=true",
    ]
    assert main(["train", "--config", cfg, *fixed]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["rollbacks"]) == ("completed", "6/6", 1)
    assert summary["resumed from"] == str(ckpt / "iteration_00000002")
    assert not marker_file.exists()
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "event" not in r]
    assert steps[-4:] == [3, 4, 5, 6]
