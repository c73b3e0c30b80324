"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning") on fp32 parameters.

Per parameter: the bias-corrected Adam direction plus decoupled decay,
``r = m_hat / (sqrt(v_hat) + eps) + wd p``, scaled by the trust ratio ``||p|| / ||r||`` (1 when
either norm is 0): ``p <- p - lr (||p|| / ||r||) r``. Norms are of the whole parameter, so for a
sharded (DTensor) parameter they are reduced over its mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.optim.adamw import init_adam_state
from lmforge.optim.update_rule import UpdateRuleOptimizer, local


def _norm(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """L2 norm of the full tensor whose local shard is ``t`` and whose layout is that of ``like``."""
    if isinstance(like, DTensor):
        full = DTensor.from_local(t, like.device_mesh, like.placements, run_check=False)
        return torch.linalg.vector_norm(full).full_tensor()
    return torch.linalg.vector_norm(t)


class LAMB(UpdateRuleOptimizer):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        model: nn.Module | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, model=model)

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        init_adam_state(self, p, state)

    def _update_group(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            g = self._grad(p)
            if g is None:
                continue
            st = self.state[p]
            w, g = local(p), local(g)
            m, v = local(st["exp_avg"]), local(st["exp_avg_sq"])
            st["step"] += 1
            t = st["step"].item()
            m.lerp_(g, 1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = (v / (1.0 - b2**t)).sqrt_().add_(eps)
            r = (m / (1.0 - b1**t)).div_(denom)
            if wd != 0:
                r.add_(w, alpha=wd)
            w_norm, r_norm = _norm(w, p), _norm(r, p)
            trust = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, torch.ones_like(w_norm))
            w.sub_(r * (lr * trust))
