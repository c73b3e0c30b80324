"""fp32 master weights and fp32 gradient accumulation, shared by every lmforge optimizer.

* Every bf16/fp16 parameter gets an fp32 master copy (``state["master"]``); an fp32 parameter is its
  own master (unless states are offloaded, then every parameter has a CPU master). The update runs on
  the masters, which are then copied back into the model parameters.
* Gradients of bf16/fp16 parameters accumulate in fp32: on one device a post-accumulate-grad hook
  adds each backward's ``.grad`` into ``param.main_grad`` (fp32) and frees ``.grad``. Read gradients
  with :func:`get_grad`. Under FSDP2 (DTensor parameters) no hook is installed: use
  ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` so the reduction runs in fp32.
* After loading model weights without optimizer state, call
  :meth:`MasterWeightOptimizer.reload_main_params_from_model` so the masters follow the model.
* All state is created in the constructor (not on the first step), so ``state_dict()`` is complete
  from the start and DCP's ``set_state_dict`` never needs a dummy step.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.optim.param_groups import check_group_coverage
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.optim")

LOW_PRECISION = (torch.bfloat16, torch.float16)


def get_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The accumulated gradient of ``param``: the fp32 ``main_grad`` when hooks keep one, else ``.grad``."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (elementwise updates run shard by shard), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _accumulate_in_fp32(param: torch.Tensor) -> None:
    g = param.grad
    if g is None:
        return
    mg = getattr(param, "main_grad", None)
    if mg is None:
        param.main_grad = g.to(torch.float32, copy=True)
    else:
        mg.add_(g)
    param.grad = None


def attach_fp32_grad_accumulation(params: Iterable[torch.Tensor]) -> list[Any]:
    """Hooks that move each backward's low-precision grad into an fp32 ``main_grad``; returns handles."""
    handles = []
    count = 0
    for p in params:
        if p.dtype in LOW_PRECISION and p.requires_grad and not isinstance(p, DTensor):
            handles.append(p.register_post_accumulate_grad_hook(_accumulate_in_fp32))
            count += 1
    if count:
        logger.info("[GradReduceFP32] Registered fp32-cast hooks on %d low-precision parameters", count)
    return handles


class MasterWeightOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose update runs on fp32 masters; subclasses implement ``_update_group``.

    Param groups may carry ``lr_scale`` (default 1.0): the lr adapter sets ``group["lr"]`` to
    ``schedule(step) * lr_scale``.
    """

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        model: nn.Module | None = None,
        offload_states: bool = False,
        accumulate_grads_in_fp32: bool = True,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.moment_dtype = moment_dtype  # bf16: compressed moments (lmforge.optim.moment_dtype)
        groups = list(params)
        if groups and isinstance(groups[0], dict):
            # Materialise each group's params once (a generator would be consumed by the check).
            groups = [
                {**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
                for g in groups
            ]
            # Checked before torch's own check, so that the error names the parameter.
            check_group_coverage(groups, model)
        else:
            check_group_coverage([{"params": groups}], model)
        super().__init__(groups, defaults)
        self.offload_states = offload_states
        for g in self.param_groups:
            g.setdefault("lr_scale", 1.0)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(all_params)}
        self._grad_hooks = attach_fp32_grad_accumulation(all_params) if accumulate_grads_in_fp32 else []
        n_master = 0
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if self._needs_master(p):
                    st["master"] = p.detach().to(self._state_device(p), torch.float32, copy=True)
                    n_master += 1
                self._init_state(g, p, st)
        logger.info(
            "[MixedPrecision] _init_main_params: %d/%d params with fp32 master copy",
            n_master,
            len(all_params),
        )

    # -- layout -------------------------------------------------------------------------------------
    def _needs_master(self, p: torch.Tensor) -> bool:
        return self.offload_states or p.dtype != torch.float32

    def _state_device(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload_states else p.device

    def param_index(self, p: torch.Tensor) -> int:
        """The position of ``p`` among all parameters of all groups (stable for a given model)."""
        return self._index[id(p)]

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the update runs on (the parameter itself when it is fp32 and not offloaded)."""
        m = self.state[p].get("master")
        return p if m is None else m

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    def _zeros_like_master(self, p: torch.Tensor) -> torch.Tensor:
        """A zero moment shaped like the master, in ``moment_dtype`` (fp32 unless compressed)."""
        return torch.zeros_like(self.master(p), dtype=self.moment_dtype, memory_format=torch.preserve_format)

    # -- the step -----------------------------------------------------------------------------------
    def _fp32_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        g = get_grad(p)
        if g is None:
            return None
        dev = self._state_device(p)
        if g.dtype != torch.float32 or g.device != dev:
            g = g.to(dev, torch.float32)
        return g

    def _update_group(self, group: dict) -> None:  # pragma: no cover
        raise NotImplementedError

    def _after_update(self) -> None:
        """Runs on the masters after every group's update, before the copy-back (QK-Clip)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._update_group(group)
        self._after_update()
        self._copy_masters_to_params()
        return loss

    @torch.no_grad()
    def _copy_masters_to_params(self) -> None:
        by_device: dict[tuple[torch.device, torch.device], tuple[list, list]] = {}
        for g in self.param_groups:
            for p in g["params"]:
                m = self.state[p].get("master")
                if m is not None:
                    dst, src = local(p), local(m)
                    pair = by_device.setdefault((dst.device, src.device), ([], []))
                    pair[0].append(dst)
                    pair[1].append(src)
        for (dst_dev, src_dev), (dst, src) in by_device.items():
            if dst_dev == src_dev:
                torch._foreach_copy_(dst, src)  # one fused pass, casting fp32 -> bf16/fp16
            else:
                for d, s in zip(dst, src):
                    d.copy_(s, non_blocking=True)

    @torch.no_grad()
    def reload_main_params_from_model(self) -> None:
        """Re-sync the fp32 masters from the model (call after a weights-only load)."""
        for g in self.param_groups:
            for p in g["params"]:
                m = self.state[p].get("master")
                if m is not None:
                    local(m).copy_(local(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for g in self.param_groups:
            for p in g["params"]:
                mg = getattr(p, "main_grad", None)
                if mg is not None:
                    if set_to_none:
                        p.main_grad = None
                    else:
                        mg.zero_()

    # -- checkpoints --------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but fp32 masters and moments stay fp32 (torch casts them to the param dtype)."""
        saved_state = state_dict["state"]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params):
            for key, value in saved_state.get(pid, {}).items():
                if torch.is_tensor(value) and key != "step":
                    # Masters fp32; moments in this run's moment_dtype (a checkpoint may differ).
                    dtype = value.dtype
                    if value.is_floating_point():
                        dtype = torch.float32 if key == "master" else self.moment_dtype
                    self.state[p][key] = value.to(self._state_device(p), dtype, copy=True)
