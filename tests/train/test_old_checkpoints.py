"""Checkpoints written by the old single-device path (bf16 parameters + fp32 masters inside the optimizer)
still resume: their fp32 weights become the fp32 parameters, and training continues where they stopped.

The fixtures were written by that code (tests/fixtures/old_single_device_ckpt/make_fixture.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import read_metrics
from lmforge.train.checkpoint.compat.fused_layout_v1 import fused_rows

from .test_train_cli import ADAMW, write_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "old_single_device_ckpt"


def _saved_tensors(ckpt: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(tmp / "flat.pt"))
    return torch.load(tmp / "flat.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("folder", "weights_in"),
    [("at_46f3119", "model"), ("at_71445a7_parent", "masters")],
    ids=["fp32-weights", "masters-in-optimizer"],
)
def test_old_single_device_checkpoint_resumes(tmp_path, folder, weights_in):
    fixture = FIXTURES / folder
    path = write_config(tmp_path, ADAMW, steps=6)
    raw = yaml.safe_load(Path(path).read_text())
    raw["model"]["head_dim"] = 8  # as make_fixture.py
    raw["checkpoint"]["load_path"] = str(fixture / "ckpt")
    Path(path).write_text(yaml.safe_dump(raw))
    saved = _saved_tensors(fixture / "ckpt" / "iteration_00000004", tmp_path)
    trainer = build_trainer(load_config(path))
    trainer.resumption.resume_or_start()
    converted = "(the old single-device path)" in (trainer.output_dir / "train.log").read_text()
    assert converted == (weights_in == "masters")
    assert trainer.state.global_step == 4
    # The fixtures also predate the shard-clean fused layout (weight layout 2): their fused rows are
    # permuted on load, so the saved tensors are compared in the new row order.
    fused = {name.lstrip("."): (dim, rows) for _, dim, rows, name in fused_rows(trainer.model)}
    assert fused, "the fixture model has fused weights"

    def in_new_layout(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(fused[name][0], fused[name][1]) if name in fused else t

    for name, p in trainer.model.named_parameters():
        expected = (
            saved["model"][name] if weights_in == "model" else saved["optimizer"]["state"][name]["master"]
        )
        assert p.dtype == torch.float32 and expected.dtype == torch.float32
        assert torch.equal(p.full_tensor(), in_new_layout(name, expected)), name  # no bf16 rounding
        state = trainer.optimizer.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        exp_avg = saved["optimizer"]["state"][name]["exp_avg"]
        assert torch.equal(state["exp_avg"].full_tensor(), in_new_layout(name, exp_avg)), name
    trainer.fit()
    ours = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    old = {r["step"]: r for r in json.loads((fixture / "metrics.json").read_text())}
    assert sorted(ours) == [5, 6]
    for step in (5, 6):
        # The same bf16 compute of the same fp32 weights; only where gradients are summed in fp32 differs.
        assert ours[step]["lr"] == old[step]["lr"]
        assert ours[step]["loss"] == pytest.approx(old[step]["loss"], rel=1e-3), step
