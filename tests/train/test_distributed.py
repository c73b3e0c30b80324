"""Under torchrun (gloo, CPU): FSDP training, and a checkpoint saved on 2 ranks resumes on 1 and on 4."""

from __future__ import annotations

import shutil

import pytest

from lmforge.train.callbacks import read_metrics
from torchrun import torchrun

from .test_train_cli import ADAMW, write_config


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_from_two_ranks_resumes_on_one_and_four(tmp_path):
    cfg = write_config(tmp_path, ADAMW, steps=6)
    # async_save: DCP writes in the background on its own gloo group while the two ranks train on.
    torchrun(2, cfg, "checkpoint.save_interleaved_steps=3", "checkpoint.async_save=true")
    two = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert [s for s, _ in two] == [1, 2, 3, 4, 5, 6] and two[-1][1] < two[0][1]
    it3 = tmp_path / "ckpt" / "iteration_00000003"
    for nproc, extra in ((1, []), (4, ["training.local_batch_size=1"])):
        out = tmp_path / f"resume{nproc}"
        overrides = [
            f"checkpoint.load_path={it3}",
            f"checkpoint.save_path={out / 'ckpt'}",
            f"output_dir={out}",
            *extra,
        ]
        if nproc == 1:
            from lmforge.cli import main

            args = ["train", "--config", cfg]
            for o in overrides:
                args += ["--set", o]
            assert main(args) == 0
        else:
            torchrun(nproc, cfg, *overrides)
        resumed = [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl")]
        assert [s for s, _ in resumed] == [4, 5, 6]
        # Same weights, optimizer state, lr and samples; only the sharding (and bf16 vs fp32 storage
        # of the weights on one process) differs, so the losses agree to bf16 precision.
        for (_, a), (_, b) in zip(two[3:], resumed):
            assert b == pytest.approx(a, rel=2e-2)
        shutil.rmtree(out)
