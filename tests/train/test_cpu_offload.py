"""``parallelism.cpu_offload: true`` on one process: a stated no-op on a CPU, refused on an accelerator."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.train.builder import build_trainer, check_cpu_offload_on_one_process

from .test_train_cli import ADAMW, write_config


def test_on_an_accelerator_it_is_refused_with_the_reason_and_the_alternative():
    with pytest.raises(ConfigError) as info:
        check_cpu_offload_on_one_process({"cpu_offload": True}, torch.device("cuda", 0))
    message = str(info.value)
    assert message.startswith("parallelism.cpu_offload: true")
    assert "optimizer.offload_states: true" in message and "torchrun" in message
    check_cpu_offload_on_one_process({"cpu_offload": False}, torch.device("cuda", 0))  # off: nothing to say


def test_on_a_cpu_it_trains_and_says_it_changes_nothing(tmp_path):
    cfg = load_config(write_config(tmp_path, ADAMW, steps=1), ["parallelism.cpu_offload=true"])
    trainer = build_trainer(cfg, device="cpu")
    assert trainer.fit()["status"] == "completed"
    assert "parallelism.cpu_offload: true has no effect" in (trainer.output_dir / "train.log").read_text()
