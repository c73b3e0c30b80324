"""Checkpoints of the former single-device path: bf16 weights in ``model.<name>``, their fp32 masters in
the optimizer state (``optimizer.state.<name>.master``). Since 71445a7 the fp32 parameters are the
masters and a checkpoint stores them as ``model.<name>``; the old masters are loaded into them here.
Removed in lmforge 0.3, with the rest of this package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.train.checkpoint.files import _distributed, _quiet_single_process
from lmforge.train.checkpoint.safe_load import load_dcp
from lmforge.train.checkpoint.state_dicts import Checkpointable, _model_state_dict, _non_strict

MASTER_STATE = "master"


def masters_in_optimizer(model_names: Any, keys: Any) -> list[str]:
    """The parameters whose fp32 weights a checkpoint holds as masters in its optimizer state."""
    return [name for name in model_names if f"optimizer.state.{name}.{MASTER_STATE}" in keys]


def load_masters(path: Path, target: Checkpointable, names: list[str]) -> None:
    """Load the fp32 masters into the model's parameters (over the bf16 copies read from ``model.<name>``)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model_sd = _model_state_dict(target.model)
    masters = {name: model_sd[name] for name in names if name in model_sd}
    sd = {"optimizer": {"state": {name: {MASTER_STATE: t} for name, t in masters.items()}}}
    with _quiet_single_process():
        load_dcp(sd, path, no_dist=not _distributed())
    set_model_state_dict(target.model, masters, options=_non_strict())
