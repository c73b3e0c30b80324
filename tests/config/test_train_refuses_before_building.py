"""`lmforge train` refuses every configuration error before it builds anything, as `check` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.cli import main


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # This checkout's sources, whatever the working directory of the child.
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "lmforge", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_misspelled_scheduler_key_is_refused_before_any_construction(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any
) -> None:
    base_config["lr_scheduler"]["warmup_stpes"] = 3
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(base_config), encoding="utf-8")
    train = _run("train", "--config", str(path), "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert main(["check", "--config", str(path)]) == 2
    assert train.returncode == 2, train.stderr
    assert (
        "lr_scheduler.warmup_stpes" in train.stderr and "lr_scheduler.warmup_stpes" in capsys.readouterr().err
    )
    # Nothing was built: no construction log line (model, optimizer, data) and no run directory.
    before_error = train.stderr.split("lr_scheduler.warmup_stpes")[0]
    assert "Model " not in before_error and "parameters" not in before_error
    assert not (tmp_path / "out").exists()


def test_missing_training_data_is_refused_before_any_construction(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any, caplog: Any
) -> None:
    path = tmp_path / "train.yaml"
    base_config["train_dataset"]["dataloader"]["config"]["data_path"] = [str(tmp_path / "absent")]
    path.write_text(yaml.safe_dump(base_config), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--output-dir", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "train_dataset.dataloader.config.data_path" in err and "not found" in err
    assert not out.exists() and not any("parameters" in r.getMessage() for r in caplog.records)
    # check validates the file and only warns: the data is the machine's state, not the file's.
    assert main(["check", "--config", str(path)]) == 0
    assert "training will refuse to start until it does" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("loader", "keys"),
    [
        ({"config": {"seq_lenght": 32}}, ["train_dataset.dataloader.config.seq_lenght"]),
        (
            {
                "type": "TextDataLoader",
                "data_path": ["a.jsonl"],
                "tokenizer": "t",
                "packk": "whole",
                "txt_key": "x",
            },
            ["train_dataset.dataloader.packk", "train_dataset.dataloader.txt_key"],
        ),
    ],
)
def test_misspelled_dataloader_key_is_refused_by_check_and_train_before_any_construction(
    tmp_path: Path,
    base_config: dict[str, Any],
    capsys: Any,
    caplog: Any,
    loader: dict[str, Any],
    keys: list[str],
) -> None:
    if "config" in loader:
        base_config["train_dataset"]["dataloader"]["config"].update(loader["config"])
    else:
        base_config["train_dataset"]["dataloader"] = loader
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(base_config), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["check", "--config", str(path)]) == 2
    checked = capsys.readouterr().err
    caplog.clear()
    assert main(["train", "--config", str(path), "--output-dir", str(out), "--device", "cpu"]) == 2
    trained = capsys.readouterr().err
    assert all(key in checked and key in trained for key in keys), (checked, trained)
    # The same refusal, and nothing built: no construction log line, no run directory.
    assert checked.split(": error: ", 1)[-1] == trained.split(": error: ", 1)[-1]
    assert not out.exists()
    assert not any("parameters" in r.getMessage() or "Model " in r.getMessage() for r in caplog.records)


def test_a_path_to_cache_that_cannot_be_written_is_refused_before_any_construction(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any, caplog: Any
) -> None:
    (tmp_path / "a_file").write_text("not a directory")
    base_config["train_dataset"]["dataloader"]["config"]["path_to_cache"] = str(tmp_path / "a_file" / "cache")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(base_config), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--output-dir", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "train_dataset.dataloader.config.path_to_cache" in err and "which is a file" in err
    assert not out.exists() and not any("parameters" in r.getMessage() for r in caplog.records)
    assert main(["check", "--config", str(path)]) == 0
    assert "training will refuse to start until it can be written" in capsys.readouterr().out
