"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on fp32 parameters.

``c = b1 m + (1 - b1) g``; ``p <- p (1 - lr wd) - lr sign(c)``; ``m <- b2 m + (1 - b2) g``.
One state tensor (``exp_avg``) per parameter instead of Adam's two. Lion's update has RMS 1, so it
wants a 3-10x smaller lr and a correspondingly larger weight decay than AdamW.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmforge.optim.update_rule import UpdateRuleOptimizer, local


class Lion(UpdateRuleOptimizer):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.01,
        *,
        model: nn.Module | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, model=model)

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        state["step"] = self._step_counter(p)
        state["exp_avg"] = self._zeros_like(p)

    def _update_group(self, group: dict) -> None:
        weights, grads, m, steps = [], [], [], []
        for p in group["params"]:
            g = self._grad(p)
            if g is None:
                continue
            weights.append(local(p))
            grads.append(local(g))
            m.append(local(self.state[p]["exp_avg"]))
            steps.append(self.state[p]["step"])
        if not weights:
            return
        lr, wd = group["lr"], group["weight_decay"]
        b1, b2 = group["betas"]
        torch._foreach_add_(steps, 1)
        c = torch._foreach_lerp(m, grads, 1.0 - b1)
        torch._foreach_sign_(c)
        if wd != 0:
            torch._foreach_mul_(weights, 1.0 - lr * wd)
        torch._foreach_add_(weights, c, alpha=-lr)
        torch._foreach_lerp_(m, grads, 1.0 - b2)
