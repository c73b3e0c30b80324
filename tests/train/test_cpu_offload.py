"""``parallelism.cpu_offload: true`` on one process: a stated no-op on a CPU, refused on an accelerator
(decided by preflight, so `lmforge check` and `lmforge train` agree)."""

from __future__ import annotations

import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.train.builder import build_trainer
from lmforge.train.preflight import check_cpu_offload_on_one_process

from .test_train_cli import ADAMW, write_config


def test_on_an_accelerator_it_is_refused_with_the_reason_and_the_alternative(tmp_path):
    path = write_config(tmp_path, ADAMW, steps=1)
    on, off = (load_config(path, [f"parallelism.cpu_offload={v}"]).parallelism for v in ("true", "false"))
    with pytest.raises(ConfigError) as info:
        check_cpu_offload_on_one_process(on, "cuda")
    message = str(info.value)
    assert message.startswith("parallelism.cpu_offload: true")
    assert "optimizer.offload_states: true" in message and "torchrun" in message
    assert check_cpu_offload_on_one_process(off, "cuda") is None  # off: nothing to say


def test_check_and_train_refuse_it_alike_when_cuda_is_found(tmp_path, monkeypatch, capsys, caplog):
    path = write_config(tmp_path, ADAMW, steps=1)
    import lmforge.utils.model_size as model_size

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device the run would use: faked
    monkeypatch.setattr(model_size, "device_memory_bytes", lambda device=None: 80 << 30)  # an 80 GiB GPU
    assert main(["check", "--config", str(path), "--set", "parallelism.cpu_offload=true"]) == 2
    checked = capsys.readouterr().err
    cfg = load_config(path, ["parallelism.cpu_offload=true"])
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:
        build_trainer(cfg, output_dir=out)  # device None: CUDA when available
    assert "parallelism.cpu_offload: true is FSDP2's CPU offload" in checked
    assert str(info.value) in checked
    # Refused before anything was built: no run directory, no model construction line.
    assert not out.exists() and not any("parameters" in r.getMessage() for r in caplog.records)
    # --device cpu: the no-op, accepted by both.
    assert (
        main(["check", "--config", str(path), "--set", "parallelism.cpu_offload=true", "--device", "cpu"])
        == 0
    )
    assert "cpu_offload: true has no effect" in capsys.readouterr().out


def test_on_a_cpu_it_trains_and_says_it_changes_nothing(tmp_path):
    cfg = load_config(write_config(tmp_path, ADAMW, steps=1), ["parallelism.cpu_offload=true"])
    trainer = build_trainer(cfg, device="cpu")
    assert trainer.fit()["status"] == "completed"
    assert "parallelism.cpu_offload: true has no effect" in (trainer.output_dir / "train.log").read_text()
