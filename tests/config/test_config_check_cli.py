"""``lmforge check``: exit codes, provenance marks, derived quantities, no tracebacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.cli import main


def _write(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["check", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_valid_config_marks_sources(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    status, out, err = _check(capsys, "--config", _write(tmp_path, base_config), "--set", "training.seed=7")
    assert status == 0, err
    assert "training.steps: 10  [file]" in out
    assert "training.seed: 7  [--set]" in out
    assert "training.max_norm: 1.0  [default]" in out
    assert "model.hidden_size: 64  [file]" in out
    assert "gradient accumulation steps: 2" in out
    assert "warm-up steps: 2" in out


def test_invalid_config_exits_2_without_traceback(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any
) -> None:
    base_config["training"]["global_batch_sze"] = 4
    status, out, err = _check(capsys, "--config", _write(tmp_path, base_config))
    assert status == 2
    assert "training.global_batch_sze" in err and "did you mean global_batch_size?" in err
    assert "Traceback" not in err and out == ""


def test_missing_file_exits_2(tmp_path: Path, capsys: Any) -> None:
    status, _, err = _check(capsys, "--config", str(tmp_path / "missing.yaml"))
    assert status == 2 and "Config file not found" in err


def test_usage_errors_exit_2(capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check"])
    assert info.value.code == 2


def test_world_size_sets_data_parallel(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    base_config["training"].update(local_batch_size=2, global_batch_size=16)
    base_config["parallelism"] = {"tensor_parallel": 2}
    status, out, _ = _check(capsys, "--config", _write(tmp_path, base_config), "--world-size", "8")
    assert status == 0
    assert "data parallel: 4" in out and "sequence parallel on" in out
    assert "gradient accumulation steps: 2" in out


def test_batch_too_small_for_data_parallel(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    status, _, err = _check(capsys, "--config", _write(tmp_path, base_config), "--world-size", "4")
    assert status == 2
    assert "The product of data_parallel and local_batch_size exceeds global_batch_size" in err
    assert "training.global_batch_size" in err


def test_inexact_division_warns_with_effective_batch(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any
) -> None:
    base_config["training"].update(local_batch_size=2, global_batch_size=7)
    status, out, _ = _check(capsys, "--config", _write(tmp_path, base_config))
    assert status == 0
    assert "gradient accumulation steps: 3" in out
    assert "the effective global batch is 6 samples" in out


def test_model_parallel_larger_than_world(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    base_config["parallelism"] = {"tensor_parallel": 4}
    status, _, err = _check(capsys, "--config", _write(tmp_path, base_config), "--world-size", "2")
    assert status == 2 and "must be less than or equal to world_size(2)" in err


def test_warmup_ratio_beats_warmup_steps(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    base_config["training"]["steps"] = 250
    base_config["lr_scheduler"].update(warmup_ratio=0.03, warmup_steps=100)
    status, out, _ = _check(capsys, "--config", _write(tmp_path, base_config))
    assert status == 0 and "warm-up steps: 7" in out


def test_missing_data_files_are_warnings(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    (tmp_path / "present.bin").write_bytes(b"")
    (tmp_path / "present.idx").write_bytes(b"")
    base_config["train_dataset"]["dataloader"]["config"] = {
        "seq_length": 32,
        "split": "98,2,0",
        "data_path": ["0.5", str(tmp_path / "present"), "0.5", str(tmp_path / "absent")],
    }
    status, out, _ = _check(capsys, "--config", _write(tmp_path, base_config))
    assert status == 0
    assert "absent' not found" in out and "present' not found" not in out


@pytest.mark.parametrize(
    ("flags", "status", "text"),
    [
        (["--mode", "1", "--use_parallel", "False"], 0, "valid configuration"),
        (["--mode", "0"], 2, "graph mode (--mode 0) is not supported"),
        (["--use_parallel", "False", "--world-size", "2"], 2, "--use_parallel False means a single process"),
        (["--use_parallel", "True", "--world-size", "2"], 0, "world size 2"),
    ],
)
def test_launch_flags(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any, flags: list[str], status: int, text: str
) -> None:
    base_config["training"]["global_batch_size"] = 4
    got, out, err = _check(capsys, "--config", _write(tmp_path, base_config), *flags)
    assert got == status and text in out + err


def test_adjusted_values_and_warnings(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    base_config["parallelism"] = {"tensor_parallel": 2, "sequence_parallel": False}
    base_config["context"] = {"device_target": "GPU"}
    status, out, err = _check(capsys, "--config", _write(tmp_path, base_config), "--world-size", "2")
    assert status == 0
    assert "parallelism.sequence_parallel: true  [file, adjusted]" in out
    assert "context.device_target = 'GPU' has no effect" in out
    assert "has no effect" not in err  # printed once, in the report


def test_typed_sections_show_their_schemas_defaults(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any
) -> None:
    # optimizer and dataloader declare only their type: a default shown is the type's schema's own.
    base_config["optimizer"] = {"type": "Muon", "betas": [0.9, 0.99]}
    status, out, err = _check(capsys, "--config", _write(tmp_path, base_config))
    assert status == 0, err
    assert "optimizer.eps: 1.0e-07  [default]" in out  # Muon's, not AdamW's 1e-8
    assert "optimizer.weight_decay: 0.1  [default]" in out
    assert "optimizer.ns_steps: 5  [default]" in out
    assert "optimizer.lr_scale: {}  [default]" in out  # written as a mapping
    assert "optimizer.betas: [0.9, 0.99]  [file]" in out  # written, kept, and warned about
    assert "optimizer.betas is not used by the Muon optimizer" in out
    assert "train_dataset.dataloader.column_names: [input_ids, labels]  [default]" in out


@pytest.mark.parametrize("optimizer", [{"type": "AdamW"}, {"type": "Muon"}, {"type": "LAMB"}])
def test_the_optimizer_defaults_check_shows_are_the_ones_in_effect(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any, optimizer: dict[str, Any]
) -> None:
    # Writing every [default] value check prints into the file must change nothing typed.
    from lmforge.config import load_config

    base_config["optimizer"] = dict(optimizer)
    status, out, err = _check(capsys, "--config", _write(tmp_path, base_config))
    assert status == 0, err
    shown = {}
    for line in out.splitlines():
        if line.startswith("  optimizer.") and line.endswith("  [default]"):
            key, value = line.strip()[len("optimizer.") : -len("  [default]")].split(": ", 1)
            shown[key] = yaml.safe_load(value)
    assert "eps" in shown or optimizer["type"] == "Lion"
    written = load_config({**base_config, "optimizer": {**optimizer, **shown}}).optimizer.typed.hyper
    implied = load_config(base_config).optimizer.typed.hyper
    assert written.model_dump(mode="json") == implied.model_dump(mode="json")  # (tuples as lists)
    assert getattr(written, "ns_schedule", None) == getattr(implied, "ns_schedule", None)
