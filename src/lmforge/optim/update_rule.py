"""The base of every lmforge optimizer: a plain update rule on fp32 (DTensor) parameters.

The trainer keeps the parameters in fp32 on every layout, one process included (FSDP2 gathers them in
``compute_dtype`` for the forward and backward and reduces gradients in fp32), so the parameters are
the master weights: the optimizer updates them in place, with its states next to them, and keeps no
second copy. Low-precision parameters are refused: updating them in place would round every step.

* Elementwise updates run shard by shard (:func:`local`); states are created like the parameter
  (a DTensor parameter gets DTensor states), so DCP saves and reshards them like the weights.
* All state is created in the constructor (not on the first step), so ``state_dict()`` is complete
  from the start and DCP's ``set_state_dict`` never needs a dummy step.
* Param groups may carry ``lr_scale`` (default 1.0): the lr adapter sets ``group["lr"]`` to
  ``schedule(step) * lr_scale``.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.errors import ConfigError
from lmforge.optim.param_groups import check_group_coverage


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (elementwise updates run shard by shard), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _refuse_low_precision(groups: list[dict], model: nn.Module | None) -> None:
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for g in groups:
        for i, p in enumerate(g["params"]):
            if p.dtype != torch.float32:
                given = g.get("param_names")
                name = names.get(id(p)) or (given[i] if given else f"#{i} of its group")
                raise ConfigError(
                    f"optimizer: parameter {name!r} is {p.dtype}; lmforge's optimizers update fp32 parameters "
                    "in place (the parameters are the master weights). The trainer keeps parameters in fp32 "
                    "and computes in model.compute_dtype; outside it, call model.float() before building the "
                    "optimizer."
                )


class UpdateRuleOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over fp32 parameters; subclasses implement ``_init_state`` and
    ``_update_group`` (and optionally ``_after_update``)."""

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        model: nn.Module | None = None,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.moment_dtype = moment_dtype  # bf16: compressed moments (lmforge.optim.moment_dtype)
        self.grad_scale = 1.0  # during step(): the factor a folding rule applies to the gradients
        groups = list(params)
        if groups and isinstance(groups[0], dict):
            # Materialise each group's params once (a generator would be consumed by the check).
            groups = [
                {**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
                for g in groups
            ]
        else:
            groups = [{"params": groups}]
        # Checked before torch's own check, so that the error names the parameter.
        check_group_coverage(groups, model)
        _refuse_low_precision(groups, model)
        super().__init__(groups, defaults)
        for g in self.param_groups:
            g.setdefault("lr_scale", 1.0)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(all_params)}
        for g in self.param_groups:
            for p in g["params"]:
                self._init_state(g, p, self.state[p])

    def param_index(self, p: torch.Tensor) -> int:
        """The position of ``p`` among all parameters of all groups (stable for a given model)."""
        return self._index[id(p)]

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    def _zeros_like(self, p: torch.Tensor) -> torch.Tensor:
        """A zero moment shaped (and sharded) like ``p``, in ``moment_dtype`` (fp32 unless compressed)."""
        return torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)

    def _step_counter(self, p: torch.Tensor) -> torch.Tensor:
        return torch.tensor(0.0, dtype=torch.float32, device=local(p).device)

    # -- the step -----------------------------------------------------------------------------------
    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 gradient of ``p`` (FSDP2 reduces in fp32; a plain fp32 module's grads are fp32)."""
        return p.grad

    def _update_group(self, group: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    def _folds_grad_scale(self, group: dict) -> bool:
        """Whether ``_update_group`` applies :attr:`grad_scale` itself (inside its kernel); otherwise
        :meth:`step` multiplies the group's gradients by it first."""
        return False

    def _after_update(self) -> None:
        """Runs after every group's update (Muon's orthogonalised updates, QK-Clip)."""

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> Any:
        """One update of every group. ``grad_scale``: the gradients enter the update multiplied by it
        (the trainer's clipping coefficient, times 1 / the fp16 loss scale). AdamW folds it into its fused
        kernel (which divides by its inverse: the same value within one rounding), which saves a pass over
        every gradient; other rules get the gradients multiplied first. Either way the gradients are left
        scaled (the fused kernel writes them back), as after ``clip_grad_norm_``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = float(grad_scale)
        # Folding divides by 1 / scale: only a finite positive scale has a finite positive inverse.
        foldable = scale != 1.0 and 0.0 < scale < float("inf")
        try:
            for group in self.param_groups:
                folds = foldable and self._folds_grad_scale(group)
                if scale != 1.0 and not folds:
                    grads = [local(p.grad) for p in group["params"] if p.grad is not None]
                    if grads:
                        torch._foreach_mul_(grads, scale)
                self.grad_scale = scale if folds else 1.0
                self._update_group(group)
            self.grad_scale = 1.0
            self._after_update()
        finally:
            self.grad_scale = 1.0
        return loss

    # -- checkpoints --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but moments keep this run's ``moment_dtype`` (torch casts them to the param dtype)."""
        saved_state = state_dict["state"]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params):
            for key, value in saved_state.get(pid, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    self.state[p][key] = value.to(local(p).device, self.moment_dtype, copy=True)
