"""CPU offload on one process: FSDP2 wraps one process too, so ``parallelism.cpu_offload`` and
``optimizer.offload_states`` are FSDP2's CPU offload there as well; on a CPU they change nothing (said
so, by preflight, so `lmforge check` and `lmforge train` agree)."""

from __future__ import annotations

import torch

from lmforge.cli import main
from lmforge.config import ParallelismConfig, load_config
from lmforge.optim import validate_optimizer
from lmforge.train.builder import _storage_device, _with_offload, build_trainer
from lmforge.train.preflight import check_cpu_offload_on_one_process

from .test_train_cli import ADAMW, write_config


def test_on_an_accelerator_offload_states_is_fsdp2_cpu_offload(tmp_path):
    cuda = torch.device("cuda", 0)
    offload = validate_optimizer({"type": "AdamW", "offload_states": True})
    resident_params = ParallelismConfig(cpu_offload=False)
    section = _with_offload(resident_params, offload, cuda)
    assert section.cpu_offload is True and _storage_device(section, cuda).type == "cpu"
    resident = validate_optimizer({"type": "AdamW"})
    assert _with_offload(resident_params, resident, cuda) == resident_params
    # On a CPU the parameters and states already are in host memory: nothing to change.
    assert _with_offload(resident_params, offload, torch.device("cpu")) == resident_params
    path = write_config(tmp_path, ADAMW, steps=1)
    on = load_config(path, ["parallelism.cpu_offload=true"]).parallelism
    assert check_cpu_offload_on_one_process(on, "cuda") is None  # accepted: FSDP2 offloads one process too
    assert "has no effect" in check_cpu_offload_on_one_process(on, "cpu")


def test_check_and_train_agree_on_a_cpu(tmp_path, capsys):
    path = write_config(tmp_path, ADAMW, steps=1)
    argv = ["check", "--config", str(path), "--set", "parallelism.cpu_offload=true", "--device", "cpu"]
    assert main(argv) == 0
    assert "cpu_offload: true has no effect" in capsys.readouterr().out


def test_on_a_cpu_it_trains_and_says_it_changes_nothing(tmp_path):
    cfg = load_config(write_config(tmp_path, ADAMW, steps=1), ["parallelism.cpu_offload=true"])
    trainer = build_trainer(cfg, device="cpu")
    assert trainer.fit()["status"] == "completed"
    assert "parallelism.cpu_offload: true has no effect" in (trainer.output_dir / "train.log").read_text()
