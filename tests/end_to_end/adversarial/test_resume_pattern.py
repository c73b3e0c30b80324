"""``checkpoint.load_path`` is explicit (a path holding nothing is an error before anything is built);
"resume if a checkpoint is there" is ``checkpoint.auto_resume: true``, which works on the first launch
too (the run lock in save_path is not in the way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.test_train_cli import ADAMW, write_config


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("where", ["missing", "empty", "only-a-lock"])
def test_an_explicit_load_path_that_holds_nothing_is_refused_before_anything_is_built(tmp_path, cli, where):
    cfg = write_config(tmp_path, ADAMW, steps=2)
    target = tmp_path / "nothing_here"
    if where != "missing":
        target.mkdir()
    if where == "only-a-lock":
        (target / ".lmforge.lock").write_text("{}")
    code, _, err = cli("train", "--config", cfg, "--set", f"checkpoint.load_path={target}")
    assert code == 2 and "Traceback" not in err
    assert f"checkpoint.load_path {str(target)!r}" in err and "checkpoint.auto_resume: true" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()  # nothing built or written
    code, out, err = cli("check", "--config", cfg, "--set", f"checkpoint.load_path={target}")
    assert code == 0 and f"checkpoint.load_path {str(target)!r}" in out and "lmforge train refuses" in out


@pytest.mark.parametrize(
    "load_path_too", [False, True], ids=["auto_resume", "auto_resume+load_path=save_path"]
)
def test_auto_resume_true_starts_from_scratch_then_resumes(tmp_path, cli, load_path_too):
    cfg = write_config(tmp_path, ADAMW, steps=2)
    sets = ["--set", "checkpoint.auto_resume=true", "--set", "checkpoint.save_interleaved_steps=2"]
    if load_path_too:
        sets += ["--set", f"checkpoint.load_path={tmp_path / 'ckpt'}"]
    code, _, err = cli("train", "--config", cfg, *sets)
    assert code == 0, err
    assert _steps(tmp_path / "run") == [1, 2] and (tmp_path / "ckpt" / "iteration_00000002").is_dir()
    code, _, err = cli("train", "--config", cfg, *sets, "--set", "training.steps=3")
    assert code == 0, err
    assert "resuming from the latest complete checkpoint" in err
    assert _steps(tmp_path / "run")[-1] == 3 and (tmp_path / "ckpt" / "iteration_00000003").is_dir()


def test_load_path_equal_to_save_path_without_auto_resume_is_refused_on_a_first_launch(tmp_path, cli):
    cfg = write_config(tmp_path, ADAMW, steps=2)
    code, _, err = cli("train", "--config", cfg, "--set", f"checkpoint.load_path={tmp_path / 'ckpt'}")
    assert code == 2 and "does not exist" in err and "checkpoint.auto_resume: true" in err


def test_a_metrics_line_cut_by_a_kill_is_tolerated_and_reported_on_resume(run_copy, cli):
    metrics = run_copy / "run" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 3, "loss": 4.1, "l')  # the kill hit while step 3 was appended
    code, _, err = cli(
        "train", "--config", run_copy / "train.yaml", "--set", f"checkpoint.load_path={run_copy / 'ckpt'}",
        "--set", "training.steps=3",
    )  # fmt: skip
    assert code == 0, err
    assert "metrics.jsonl: dropped 1 line(s) that are not a step record (line 3)" in err
    lines = metrics.read_text().splitlines()
    assert lines[:2] == whole.splitlines() and [json.loads(line)["step"] for line in lines] == [1, 2, 3]


@pytest.mark.parametrize("old_state", ["live missing", "live complete"])
def test_leftovers_of_a_crashed_save_are_recovered_or_removed_on_the_next_run(run_copy, cli, old_state):
    import shutil

    ckpt = run_copy / "ckpt"
    (ckpt / ".iteration_00000004.partial").mkdir()  # a save killed while writing
    (ckpt / ".iteration_00000004.partial" / "x.distcp").write_bytes(b"half")
    (ckpt / ".latest_checkpointed_iteration.txt.tmp").write_text("4")
    if old_state == "live missing":  # killed between the two renames of a re-save of step 2
        (ckpt / "iteration_00000002").rename(ckpt / ".iteration_00000002.old")
    else:  # killed after the new copy was in place, before the old one was removed
        shutil.copytree(ckpt / "iteration_00000002", ckpt / ".iteration_00000002.old")
    code, _, err = cli(
        "train", "--config", run_copy / "train.yaml", "--set", "checkpoint.auto_resume=true",
        "--set", "training.steps=3",
    )  # fmt: skip
    assert code == 0, err
    assert "resuming from the latest complete checkpoint" in err and "(iteration 2)" in err
    hidden = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".") and p.name != ".lmforge.lock")
    assert hidden == [] and (ckpt / "iteration_00000002" / ".metadata").is_file()
    assert "removed the interrupted save .iteration_00000004.partial" in err
