"""fp16 dynamic loss scaling: the policy, agreement with fp32/bf16 curves, an injected overflow, resume."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import TrainerCallback, read_metrics
from lmforge.train.loss_scale import LossScaler

from .test_train_cli import ADAMW, write_config


def test_policy_backs_off_on_overflow_and_grows_after_clean_intervals():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    for overflow, expected in [(False, 1024), (False, 1024), (True, 512), (False, 512), (False, 512)]:
        scaler.update(overflow)
        assert scaler.scale == expected
    scaler.update(False)  # third clean update since the overflow
    assert scaler.scale == 1024 and scaler.good_steps == 0
    restored = LossScaler(growth_interval=3)
    restored.load_state_dict({**scaler.state_dict(), "good_steps": 2})
    assert (restored.scale, restored.good_steps) == (1024.0, 2)


def _run(tmp_path, dtype, steps=8, callbacks=(), overrides=()):
    cfg = load_config(
        write_config(tmp_path, ADAMW, steps=steps),
        [f"model.compute_dtype={dtype}", "checkpoint.save_interleaved_steps=4", *overrides],
    )
    trainer = build_trainer(cfg, device="cpu")
    for cb in callbacks:
        trainer.callbacks.add(cb)
    summary = trainer.fit()
    return trainer, summary, read_metrics(trainer.output_dir / "metrics.jsonl")


@pytest.mark.slow
def test_fp16_run_matches_fp32_and_bf16_loss_and_grad_norm_curves(tmp_path):
    runs = {}
    for dtype in ("float32", "bfloat16", "float16"):
        (tmp_path / dtype).mkdir()
        _, _, runs[dtype] = _run(tmp_path / dtype, dtype, steps=6)
    fp16 = runs["float16"]
    assert [r["loss_scale"] for r in fp16] == [2.0**16] * 6 and not any(r.get("skipped") for r in fp16)
    assert all("loss_scale" not in r for r in runs["float32"] + runs["bfloat16"])
    # fp16 has 3 more mantissa bits than bf16: it tracks the fp32 run closely, loss and gradient
    # norm. The norm is computed after unscaling, so a wrong unscale (hidden from the loss by
    # clipping) would be off by the scale.
    for a, b in zip(fp16, runs["float32"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2), a["step"]
    # bf16 drifts from fp32 itself (its gradient norm by tens of percent after a few steps); the
    # loss curves agree within bf16's precision.
    for a, b in zip(fp16, runs["bfloat16"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2), a["step"]


class InjectOverflow(TrainerCallback):
    """Makes one parameter's gradient inf during the given (1-based) step; the loss stays finite."""

    def __init__(self, step):
        self.step, self.handle = step, None

    def on_step_begin(self, args, state, **kw):
        if state.global_step + 1 == self.step:
            p = next(p for p in kw["model"].parameters() if p.requires_grad)
            # After FSDP2's reduce-scatter into the (sharded) gradient: a tensor hook on the sharded
            # parameter would never fire.
            self.handle = p.register_post_accumulate_grad_hook(lambda q: q.grad.fill_(float("inf")))

    def on_step_end(self, args, state, **kw):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


@pytest.mark.slow
def test_injected_overflow_is_skipped_scale_lowers_training_continues_and_resumes(tmp_path):
    trainer, summary, records = _run(tmp_path, "float16", steps=4, callbacks=[InjectOverflow(2)])
    assert [r.get("skipped", False) for r in records] == [False, True, False, False]
    assert "float16 gradient overflow at loss scale 65536 (lowered to 32768)" in records[1]["skip_reason"]
    assert [r["loss_scale"] for r in records] == [65536, 65536, 32768, 32768]
    assert summary["status"] == "completed" and summary["skipped steps"] == 1
    assert trainer.state.consecutive_skips == 0
    assert records[3]["loss"] < records[0]["loss"]  # training went on
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert "loss_scale: 32768" in (trainer.output_dir / "train.log").read_text()
    # The scale is in the checkpoint (the original's common.json field) and restored on resume.
    common = json.loads((tmp_path / "ckpt" / "iteration_00000004" / "common.json").read_text())
    assert common["loss_scale"] == 32768
    resumed, _, more = _run(
        tmp_path, "float16", steps=5, overrides=[f"checkpoint.load_path={tmp_path / 'ckpt'}"]
    )
    assert [r["step"] for r in more][-1] == 5 and more[-1]["loss_scale"] == 32768
    assert resumed.state.loss_scaler["good_steps"] == 3  # steps 3, 4 before the save, 5 after
