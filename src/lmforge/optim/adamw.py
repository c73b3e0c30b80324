"""AdamW on fp32 parameters: decoupled decay ``p <- p(1 - lr wd)``, bias correction with t from 1.

The update is torch's fused AdamW kernel (one pass over memory per tensor list) applied to the
parameters, grouped per param group; optimizer states are fp32 and named ``exp_avg`` / ``exp_avg_sq``
(the original's ``adam_m`` / ``adam_v``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmforge.optim.moment_dtype import narrow_, widen
from lmforge.optim.update_rule import UpdateRuleOptimizer, local


def init_adam_state(opt: UpdateRuleOptimizer, p: torch.Tensor, state: dict, amsgrad: bool = False) -> None:
    state["step"] = opt._step_counter(p)
    state["exp_avg"] = opt._zeros_like(p)
    state["exp_avg_sq"] = opt._zeros_like(p)
    if amsgrad:
        state["max_exp_avg_sq"] = opt._zeros_like(p)


def adam_update(
    opt: UpdateRuleOptimizer,
    params: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    """One AdamW step for ``params``; parameters without a gradient are skipped."""
    weights, grads, m, v, vmax, steps, ids = [], [], [], [], [], [], []
    for p in params:
        g = opt._grad(p)
        if g is None:
            continue
        ids.append(opt.param_index(p))
        st = opt.state[p]
        weights.append(local(p))
        grads.append(local(g))
        m.append(local(st["exp_avg"]))
        v.append(local(st["exp_avg_sq"]))
        if amsgrad:
            vmax.append(local(st["max_exp_avg_sq"]))
        steps.append(st["step"])
    if not weights:
        return
    torch._foreach_add_(steps, 1)
    # Compressed (bf16) moments: the update runs on fp32 copies, stored back stochastically rounded.
    m32, v32, vmax32 = widen(m), widen(v), widen(vmax)
    # The step's gradient scale (clipping), folded into the kernel: it divides the gradients by this.
    inverse = None
    if opt.grad_scale != 1.0:
        inverse = torch.tensor(1.0 / opt.grad_scale, dtype=torch.float32, device=weights[0].device)
    torch._fused_adamw_(
        weights,
        grads,
        m32,
        v32,
        vmax32,
        steps,
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=inverse,
    )
    if opt.moment_dtype != torch.float32:
        step = int(steps[0].item())
        narrow_(m, m32, step, [3 * i for i in ids])
        narrow_(v, v32, step, [3 * i + 1 for i in ids])
        narrow_(vmax, vmax32, step, [3 * i + 2 for i in ids])


class AdamW(UpdateRuleOptimizer):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        maximize: bool = False,
        *,
        model: nn.Module | None = None,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize
        )
        super().__init__(params, defaults, model=model, moment_dtype=moment_dtype)

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        init_adam_state(self, p, state, group["amsgrad"])

    def _folds_grad_scale(self, group: dict) -> bool:
        return True  # adam_update passes it to the fused kernel

    def _update_group(self, group: dict) -> None:
        adam_update(
            self,
            group["params"],
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
        )
