"""Training quality with bf16 optimizer moments on the real stack (tiny Qwen3, a handful of steps):
the final loss is within 2 % of the run with fp32 moments. The demo-length comparison is in
bench/bench_moment_dtype.py (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import read_metrics

from .test_train_cli import ADAMW, MUON, write_config


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [ADAMW, MUON], ids=["adamw", "muon"])
def test_final_loss_with_bf16_moments_is_within_2_percent_of_fp32(tmp_path, optimizer):
    finals = {}
    for dtype in ("float32", "bfloat16"):
        (tmp_path / dtype).mkdir()
        cfg = load_config(
            write_config(tmp_path / dtype, {**optimizer, "moment_dtype": dtype}, steps=10),
            ["checkpoint.enable_save=false"],
        )
        trainer = build_trainer(cfg, device="cpu")
        trainer.fit()
        records = read_metrics(trainer.output_dir / "metrics.jsonl")
        assert len(records) == 10 and not any(r.get("skipped") for r in records)
        finals[dtype] = sum(r["loss"] for r in records[-3:]) / 3
    assert finals["bfloat16"] == pytest.approx(finals["float32"], rel=0.02)
