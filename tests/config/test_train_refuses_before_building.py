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
