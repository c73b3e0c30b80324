"""Loading checkpoints written with an older row layout of the fused weights (removed in lmforge 0.3).

``common.json`` records ``weight_layout`` (``models/common/fused_layout.py``); a checkpoint without it has
layout 1 (``[Q; K; V]``, ``[gate; up]``, MLA pieces grouped by part). After such a checkpoint is loaded,
the rows of every fused weight — and of the bias, LoRA ``B`` and optimizer state (moments, masters) that
follow its rows — are permuted in place into the current layout. A sharded (DTensor) tensor is gathered
one at a time for this, a one-off cost at load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmforge.models.common.fused_layout import WEIGHT_LAYOUT
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

# The parameters of a fused child that share its output rows (an nn.Linear, a LoRALinear, an ExpertWeight).
_ROW_PARAMS = ("weight", "bias", "lora_B.weight")


def fused_rows(model: nn.Module) -> list[tuple[nn.Parameter, int, torch.Tensor, str]]:
    """(parameter, dim, rows with ``current = layout1[rows]``, name) of every fused parameter of ``model``."""
    out = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        hook = getattr(module, "layout_v1_rows", None)
        if not callable(hook):
            continue
        for child_path, (dim, rows) in hook().items():
            child = module.get_submodule(child_path)
            for param_path in _ROW_PARAMS:
                owner_path, _, attr = param_path.rpartition(".")
                owner = getattr(child, owner_path, None) if owner_path else child
                p = getattr(owner, attr, None) if owner is not None else None
                if isinstance(p, nn.Parameter) and id(p) not in seen:
                    seen.add(id(p))
                    out.append((p, dim, rows, f"{prefix}.{child_path}.{param_path}"))
    return out


def _permute_(t: torch.Tensor, dim: int, rows: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            full = t.full_tensor().index_select(dim, rows.to(t.device))
            # Every rank holds the same full tensor: each keeps its own shard, without communication.
            mine = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(mine.to_local())
        else:
            t.copy_(t.index_select(dim, rows.to(t.device)))


def upgrade_fused_layout(
    model: nn.Module, optimizer: Any, layout: int, path: Any, adapters_only: bool
) -> None:
    """Permute the fused rows of ``model`` (and ``optimizer``'s state of them) loaded from a layout-``layout``
    checkpoint into the current layout. ``adapters_only``: the checkpoint held only LoRA adapters (the base
    came from elsewhere, already in the current layout)."""
    if layout == WEIGHT_LAYOUT:
        return
    if layout != 1:
        from lmforge.errors import CheckpointError

        raise CheckpointError(
            f"Checkpoint {path} has weight_layout {layout} in its common.json; this lmforge reads layouts 1 and "
            f"{WEIGHT_LAYOUT}. Use the lmforge version that wrote it, or a newer one."
        )
    from lmforge.models.lora import is_lora_param_name

    state = getattr(optimizer, "state", {}) if optimizer is not None else {}
    count = 0
    for p, dim, rows, name in fused_rows(model):
        if adapters_only and not is_lora_param_name(name):
            continue
        _permute_(p, dim, rows)
        for value in state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value is not p:
                _permute_(value, dim, rows)
        count += 1
    logger.info(
        "Checkpoint %s has fused weights in layout 1 ([Q; K; V], [gate; up]); %d tensors converted to layout %d "
        "on load.",
        path,
        count,
        WEIGHT_LAYOUT,
    )
