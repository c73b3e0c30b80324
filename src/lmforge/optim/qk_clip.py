"""QK-Clip (Kimi K2's MuonClip) applied to the fp32 parameters (the master weights) after the optimizer update.

The rule is documented in :mod:`lmforge.utils.qk_clip`: per head ``gamma_h = min(1, tau / m_h)``
from the step's maximum logit ``m_h`` (all-reduced with MAX over the data/context-parallel group
first, so replicated weights stay identical), each target's row group scaled by
``min(gamma over its heads) ** exponent``. Nothing is touched unless some head exceeds ``tau``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.utils.logging import get_logger
from lmforge.utils.qk_clip import QKClipLayer, QKClipTarget

logger = get_logger("lmforge.optim")


def synced_max_logits(
    layers: list[QKClipLayer], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Every layer's per-head max logit, reduced with MAX across ``group`` when distributed."""
    if not layers:
        return []
    flat = torch.cat([layer.max_logits.detach().float().reshape(-1) for layer in layers])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        flat = flat.clone()
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return list(torch.split(flat, [layer.max_logits.numel() for layer in layers]))


def row_scale(target: QKClipTarget, gamma: torch.Tensor, size: int) -> torch.Tensor:
    """A length-``size`` vector of per-row factors along ``target.dim`` (1 for untouched rows)."""
    factors = gamma[target.heads.to(gamma.device)].amin(dim=1) ** target.exponent  # [G]
    scale = torch.ones(size, dtype=torch.float32, device=gamma.device)
    rows = target.rows.to(gamma.device)
    scale[rows.reshape(-1)] = factors.repeat_interleave(rows.shape[1])
    return scale


@torch.no_grad()
def scale_rows_(master: torch.Tensor, dim: int, scale: torch.Tensor) -> None:
    """``master`` (fp32, possibly a DTensor shard) times ``scale`` broadcast along ``dim``."""
    shape = [1] * master.dim()
    shape[dim] = -1
    full_scale = scale.to(master.device if not isinstance(master, DTensor) else scale.device).view(shape)
    if isinstance(master, DTensor):
        # Slice the scale exactly like the weight (no communication: every rank holds the full scale).
        expanded = full_scale.expand(master.shape).contiguous()
        local_scale = distribute_tensor(expanded, master.device_mesh, master.placements, src_data_rank=None)
        master.to_local().mul_(local_scale.to_local().to(master.to_local().device))
    else:
        master.mul_(full_scale)


@torch.no_grad()
def apply_qk_clip(
    layers: list[QKClipLayer],
    threshold: float,
    master_of: Callable[[str], torch.Tensor | None],
    group: dist.ProcessGroup | None = None,
) -> int:
    """Scale the rows of every clipped head; returns how many layers were clipped."""
    active = [layer for layer in layers if not layer.qk_norm]
    maxima = synced_max_logits(active, group)
    clipped = 0
    for layer, m in zip(active, maxima):
        if not bool((m > threshold).any()):
            continue
        gamma = torch.where(m > threshold, threshold / m, torch.ones_like(m))
        for target in layer.targets:
            master = master_of(target.param_name)
            if master is None:
                raise KeyError(
                    f"QK-Clip target {target.param_name} of {layer.name} is not optimised by this optimizer"
                )
            scale_rows_(master, target.dim, row_scale(target, gamma, master.shape[target.dim]))
        clipped += 1
        heads = torch.nonzero(m > threshold).flatten().tolist()
        logger.info(
            "QK-Clip: %s heads %s had max logit %.4g > %g; their q/k rows were scaled",
            layer.name,
            heads,
            float(m.max()),
            threshold,
        )
    return clipped
