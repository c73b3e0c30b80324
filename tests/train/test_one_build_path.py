"""One process takes the same build and numerics path as every parallel layout: meta build, FSDP2
(fp32 parameters, compute in compute_dtype, fp32 gradients), materialise, initialise."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lmforge.config import load_config
from lmforge.train.builder import build_trainer

from .test_train_cli import ADAMW, write_config


def test_one_process_is_fsdp2_with_fp32_parameters_states_and_gradients(tmp_path):
    cfg = load_config(write_config(tmp_path, ADAMW, steps=1))  # model.compute_dtype: bfloat16
    trainer = build_trainer(cfg, device="cpu")
    model = trainer.model
    # One FSDP unit: at one rank in bf16 a model this small is grouped into the root (parallel/fsdp.py,
    # tests/parallel/test_fsdp_units.py); several ranks give each layer its own.
    assert isinstance(model, FSDPModule)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params.values())
    assert model.compute_dtype == torch.bfloat16
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # computed in compute_dtype from the fp32 parameters
        assert model(ids).logits.dtype == torch.bfloat16
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in params.values()]
    assert all(isinstance(g, DTensor) and g.dtype == torch.float32 for g in grads)
    assert not any(hasattr(p, "main_grad") for p in params.values())
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.fit()
    for p in params.values():
        state = trainer.optimizer.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # no master copy: the parameter is one
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].dtype == torch.float32
