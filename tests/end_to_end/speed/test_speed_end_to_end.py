"""The speed keys through the real builder and trainer: chunked loss, packed documents, float8, MFU override."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import read_metrics


def _train_cli_helpers():
    path = Path(__file__).parents[2] / "train" / "test_train_cli.py"
    spec = importlib.util.spec_from_file_location("lmforge_train_cli_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_with_speed_keys(tmp_path):
    pytest.importorskip("torchao.float8")
    helpers = _train_cli_helpers()
    path = Path(helpers.write_config(tmp_path, helpers.ADAMW, steps=6))
    raw = yaml.safe_load(path.read_text())
    raw["model"]["loss_chunk_size"] = 10
    raw["float8"] = {"enable": True, "emulate": True}
    raw["mfu"] = {"peak_tflops": 0.5}
    data = raw["train_dataset"]["dataloader"]
    data["column_names"].append("actual_seq_len")
    data["config"].update(create_compressed_eod_mask=True, reset_position_ids=True, eod_pad_length=16)
    path.write_text(yaml.safe_dump(raw))
    trainer = build_trainer(load_config(str(path)))
    from torchao.float8.float8_linear import Float8Linear

    assert sum(isinstance(m, Float8Linear) for m in trainer.model.modules()) == 8
    trainer.fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 6 and records[-1]["loss"] < records[0]["loss"]
    assert "MFU denominator: mfu.peak_tflops = 0.5 TFLOP/s" in (tmp_path / "run" / "train.log").read_text()
    assert records[0]["mfu"] == pytest.approx(records[0]["tflops_per_device"] / 0.5)
