"""``build_optimizer(section, model, lr)``: the ``optimizer`` section plus a model to an optimizer."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from lmforge.config.sections_components import OptimizerConfig
from lmforge.errors import ConfigError
from lmforge.optim.adamw import AdamW
from lmforge.optim.lamb import LAMB
from lmforge.optim.lion import Lion
from lmforge.optim.model_chunks import as_model
from lmforge.optim.moment_dtype import MOMENT_DTYPES
from lmforge.optim.muon import Muon, is_muon_shape
from lmforge.optim.param_groups import build_param_groups
from lmforge.optim.specs import OptimizerOptions
from lmforge.optim.update_rule import UpdateRuleOptimizer
from lmforge.utils.name_patterns import first_match


def initial_lr(lr: Any) -> float:
    """A float lr, or ``lr_at(0)`` of a schedule."""
    if hasattr(lr, "lr_at"):
        return float(lr.lr_at(0))
    return float(lr)


def build_optimizer(
    section: OptimizerConfig | OptimizerOptions,
    model: nn.Module | list[nn.Module] | None,
    lr: Any,
    *,
    qk_clip_group: dist.ProcessGroup | None = None,
) -> UpdateRuleOptimizer:
    """Build the optimizer of the typed ``optimizer`` section over ``model``'s trainable parameters.

    ``section`` is ``cfg.optimizer`` (or ``lmforge.config.validate_section("optimizer", mapping)``),
    typed at load into :class:`OptimizerOptions`, or those options themselves (the run plan's).
    ``lr`` is a float or a schedule (``lr_at(step)``); each group's ``lr`` starts at
    ``initial lr * lr_scale``. ``qk_clip_group`` is the data x context parallel group over which
    Muon's QK-Clip max logits are reduced (default: the world group when distributed).
    """
    opts = section if isinstance(section, OptimizerOptions) else getattr(section, "typed", None)
    if not isinstance(opts, OptimizerOptions):
        raise TypeError(
            "build_optimizer takes the typed optimizer section (load_config's cfg.optimizer, or "
            f"lmforge.config.validate_section('optimizer', mapping)), got {type(section).__name__}"
        )
    if model is None:
        key = "type"
        raise ConfigError(
            f"optimizer.{key}: Model must be provided for {opts.type} optimizer."
            if opts.type == "Muon"
            else f"optimizer.{key}: a model is needed to build the {opts.type} optimizer."
        )
    # Several pipeline chunks on one rank: one optimizer, and the section's rules apply to every chunk.
    model = as_model(model)
    lr0 = initial_lr(lr)
    h = opts.hyper
    if h.offload_states:
        _check_states_in_host_memory(model)

    if opts.type == "Muon":
        patterns = h.adamw_include

        def route(p, names):
            if is_muon_shape(p) and first_match(names, patterns) is None:
                return "muon"
            return "adamw"

        groups = build_param_groups(model, opts.grouping, route)
    else:
        groups = build_param_groups(model, opts.grouping)
    for g in groups:
        g["lr"] = lr0 * g["lr_scale"]
    if not groups:
        raise ConfigError("optimizer: the model has no trainable parameters.")

    if opts.type == "AdamW":
        return AdamW(
            groups,
            lr=lr0,
            betas=h.betas,
            eps=h.eps,
            weight_decay=opts.grouping.weight_decay,
            amsgrad=h.amsgrad,
            maximize=h.maximize,
            model=model,
            moment_dtype=MOMENT_DTYPES[h.moment_dtype],
        )
    if opts.type == "Lion":
        return Lion(
            groups,
            lr=lr0,
            betas=h.betas,
            weight_decay=opts.grouping.weight_decay,
            model=model,
        )
    if opts.type == "LAMB":
        return LAMB(
            groups,
            lr=lr0,
            betas=h.betas,
            eps=h.eps,
            weight_decay=opts.grouping.weight_decay,
            model=model,
        )
    return Muon(
        groups,
        lr=lr0,
        weight_decay=opts.grouping.weight_decay,
        matched_adamw_rms=h.matched_adamw_rms,
        momentum=h.momentum,
        eps=h.eps,
        nesterov=h.nesterov,
        ns_schedule=h.ns_schedule,
        adamw_betas=h.adamw_betas,
        adamw_eps=h.adamw_eps,
        qk_clip_enabled=h.qk_clip_enabled,
        qk_clip_threshold=h.qk_clip_threshold,
        comm_strategy=h.comm_strategy,
        ns_dtype=h.ns_dtype,
        model=model,
        qk_clip_group=qk_clip_group,
        moment_dtype=MOMENT_DTYPES[h.moment_dtype],
    )


def _check_states_in_host_memory(model: nn.Module) -> None:
    """``optimizer.offload_states``: states live where the parameters do, so the parameters must be in
    host memory; the trainer puts them there with FSDP2's CPU offload (parallel/fsdp.py)."""
    on_device = sorted({p.device.type for p in model.parameters() if p.device.type != "cpu"})
    if on_device:
        raise ConfigError(
            f"optimizer.offload_states: true keeps the optimizer states in host memory next to the fp32 "
            f"parameters, which the trainer offloads with FSDP2's CPU offload; this model's parameters are on "
            f"{', '.join(on_device)}. Build the optimizer through the trainer (lmforge train) or move the "
            "parameters to the CPU first."
        )
