"""Activation memory: recompute (full / select / exclude_op), communication recompute and swap.

The YAML sections ``recompute``, ``recompute_comm`` and ``swap`` name decoder layers by layer specs
(``'0-3'``, ``'5'``) and submodules by name patterns (the one rule of
:mod:`lmforge.utils.name_patterns`: exact, part with aliases, glob or regular expression) matched
against the dotted path of every submodule of a decoder layer. Unlike the original (which only applies them when
the world size is above one) they apply on one device too.

* Recompute makes a module a :class:`Recomputed` one, whose forward runs the original under
  non-reentrant ``torch.utils.checkpoint``. Like torch's ``fully_shard``, the wrapper is a subclass
  of the module's own class (``RecomputedTransformerLayer``), so it shows in ``print(model)`` while
  the module stays in place: parameter names, state_dict keys, optimizer name patterns and FSDP are
  unaffected (no ``_checkpoint_wrapped_module`` segment, no method assigned to the instance).
  ``exclude_op`` turns this into selective activation checkpointing: ops whose name contains an
  entry are saved (``MUST_SAVE``), everything else is recomputed.
* Communication recompute checkpoints the matched modules with a policy that saves every op except
  the collectives (``_c10d_functional`` / ``c10d`` ops), which are re-run in backward.
* Swap makes a layer (``layer_swap``) or a submodule (``op_swap``) a :class:`Swapped` one, whose
  forward runs in ``torch.autograd.graph.saved_tensors_hooks`` that move saved activations to pinned
  CPU memory on a side stream and fetch them back in backward, ``default_prefetch`` swapped layers
  ahead. On a CPU run the "move" is a no-op, but the bookkeeping is identical, so what is swapped
  can still be measured as bytes no longer kept by autograd on the compute device.

Recompute and swap only change where activations live, never the arithmetic: gradients are bitwise
identical to a run without them (the recomputed forward re-runs the same kernels with the same RNG
state).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lmforge.config.sections_parallel import RecomputeCommConfig, RecomputeConfig, SwapConfig
from lmforge.errors import ConfigError
from lmforge.parallel.activation_layers import (
    DecoderLayer,
    _already_covered,
    _compile_pattern,
    _layers_of,
    _match_modules,
    _module_specs,
    _no_match_error,
    find_decoder_layers,
)
from lmforge.parallel.activation_swap import ActivationSwap, swap_module
from lmforge.parallel.activation_wrappers import (
    ActivationWrapper,
    _comm_recompute_policy,
    _exclude_op_policy,
    is_recomputed,
    recompute_module,
)


@dataclass
class ActivationPlan:
    """What was applied (for the start-of-run log and for tests)."""

    full_layers: list[int] = field(default_factory=list)
    select: dict[str, list[int]] = field(default_factory=dict)  # pattern -> layers
    selected_paths: list[str] = field(default_factory=list)  # qualified module paths
    exclude_op: list[str] = field(default_factory=list)
    comm_paths: list[str] = field(default_factory=list)
    comm_note: str = ""
    layer_swap: list[int] = field(default_factory=list)
    op_swap: dict[str, list[int]] = field(default_factory=dict)
    swapped_paths: list[str] = field(default_factory=list)
    prefetch: int = 0
    swapper: ActivationSwap | None = None
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)  # every wrapped module

    def never_ran(self) -> list[str]:
        """Wrapped modules whose forward has not run in training (a model that calls their parts
        directly, never the module itself): recompute / swap has no effect on them."""
        return [name for name, m in self.modules if not m.activation_ran]

    def summary(self) -> str:
        parts: list[str] = []
        if self.full_layers:
            parts.append(f"recompute full: layers {_ranges(self.full_layers)}")
        for pattern, layers in self.select.items():
            parts.append(f"recompute select {pattern!r}: layers {_ranges(layers)}")
        if self.exclude_op:
            parts.append(f"recompute keeps outputs of ops containing {self.exclude_op}")
        if self.comm_note:
            parts.append(self.comm_note)
        if self.layer_swap:
            parts.append(f"swap layers {_ranges(self.layer_swap)} to CPU (prefetch {self.prefetch})")
        for pattern, layers in self.op_swap.items():
            parts.append(f"swap {pattern!r} of layers {_ranges(layers)} to CPU (prefetch {self.prefetch})")
        return "; ".join(parts) if parts else "activation memory: no recompute, no swap"


def _ranges(ids: Sequence[int]) -> str:
    ids = sorted(set(ids))
    out: list[str] = []
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def apply_activation_memory(
    model: nn.Module,
    recompute: RecomputeConfig | None = None,
    recompute_comm: RecomputeCommConfig | None = None,
    swap: SwapConfig | None = None,
    num_layers: int | None = None,
    *,
    pipeline_parallel: int = 1,
    has_comm_ops: bool = False,
) -> ActivationPlan:
    """Apply recompute, comm recompute and swap (the typed sections; None: the section's defaults) to
    ``model`` in place; return the plan (``summary()`` is its one-line description, ``never_ran()`` the
    parts whose forward has not run; the builder hands it to the trainer's ``ActivationPlanCallback``).

    ``num_layers``: decoder layers of the whole model (MTP layers come after them); layer specs are
    checked against it plus the MTP layers found. ``has_comm_ops``: whether the model's forward runs
    collectives (tensor / sequence / context / expert parallel); without them ``recompute_comm`` has
    nothing to do and says so.
    """
    return plan_activation_memory(
        model,
        recompute,
        recompute_comm,
        swap,
        num_layers,
        pipeline_parallel=pipeline_parallel,
        has_comm_ops=has_comm_ops,
    )


@dataclass
class _ModelLayers:
    """The decoder (and MTP) layers of this model or pipeline stage, and how many the whole model has."""

    by_id: dict[int, DecoderLayer]
    total: int

    def present(self, ids: Sequence[int]) -> list[DecoderLayer]:
        # Under pipeline parallelism a stage holds only some layers; the others are not ours.
        return [self.by_id[i] for i in ids if i in self.by_id]


def _model_layers(model: nn.Module, num_layers: int | None) -> _ModelLayers:
    layers = find_decoder_layers(model, num_layers)
    if not layers:
        raise ConfigError(
            "recompute / recompute_comm / swap name decoder layers, but the model has no decoder layer "
            "container (a ModuleList or ModuleDict named 'layers', e.g. decoder.layers.N)"
        )
    mtp_count = sum(1 for d in layers if num_layers is not None and d.layer_id >= num_layers)
    # A pipeline stage may hold no MTP layer; the model's config still knows how many there are.
    configured_mtp = getattr(getattr(model, "config", None), "mtp_num_layers", None)
    if isinstance(configured_mtp, int) and num_layers is not None:
        mtp_count = max(mtp_count, configured_mtp)
    total = (num_layers if num_layers is not None else len(layers) - mtp_count) + mtp_count
    return _ModelLayers({d.layer_id: d for d in layers}, total)


def plan_activation_memory(
    model: nn.Module,
    recompute: RecomputeConfig | None = None,
    recompute_comm: RecomputeCommConfig | None = None,
    swap: SwapConfig | None = None,
    num_layers: int | None = None,
    *,
    pipeline_parallel: int = 1,
    has_comm_ops: bool = False,
) -> ActivationPlan:
    """Like :func:`apply_activation_memory`, returning the :class:`ActivationPlan`."""
    recompute = recompute if recompute is not None else RecomputeConfig()
    recompute_comm = recompute_comm if recompute_comm is not None else RecomputeCommConfig()
    swap = swap if swap is not None else SwapConfig()
    mode = recompute.mode
    plan = ActivationPlan()
    if mode == "None" and not recompute_comm.enable and not swap.enable:
        if recompute.exclude_op:
            warnings.warn(
                "recompute.exclude_op has no effect while recompute.mode is 'None'", UserWarning, stacklevel=3
            )
        return plan
    layers = _model_layers(model, num_layers)
    exclude_op = list(recompute.exclude_op or [])
    policy = _exclude_op_policy(exclude_op) if exclude_op else None
    plan.exclude_op = [str(e) for e in exclude_op]
    full_ids = _apply_full(plan, layers, recompute, policy)
    if mode == "select":
        _apply_select(plan, layers, recompute, policy, full_ids)
    if recompute_comm.enable:
        _apply_comm(plan, layers, recompute_comm, full_ids, has_comm_ops)
    if swap.enable:
        _apply_swap(plan, layers, swap, full_ids, pipeline_parallel)
    plan.modules = [(name, m) for name, m in model.named_modules() if isinstance(m, ActivationWrapper)]
    return plan


def _apply_full(
    plan: ActivationPlan, layers: _ModelLayers, recompute: RecomputeConfig, policy: Any
) -> set[int]:
    mode = recompute.mode
    full_ids: set[int] = set()
    if mode in ("full", "select") and recompute.full_recompute_layer is not None:
        full_ids = set(
            _layers_of(recompute.full_recompute_layer, "recompute.full_recompute_layer", layers.total)
        )
    elif mode == "full":
        raise ConfigError(
            "recompute.full_recompute_layer is required when recompute.mode is 'full': a list of layer specs "
            "such as ['0-3'] or ['0', '5']"
        )
    for d in layers.present(sorted(full_ids)):
        recompute_module(d.module, policy)
    plan.full_layers = sorted(full_ids)
    return full_ids


def _apply_select(
    plan: ActivationPlan, layers: _ModelLayers, recompute: RecomputeConfig, policy: Any, full_ids: set[int]
) -> None:
    pairs = _module_specs(recompute.select_module, "recompute.select_module")
    if not pairs and not full_ids:
        raise ConfigError(
            "recompute.select_module is required when recompute.mode is 'select': a mapping "
            "{module pattern: [layer specs]}, e.g. {'self_attention': ['0-1'], 'mlp': ['2']}"
        )
    taken: dict[int, set[str]] = {}
    for pattern, specs in pairs:
        label = f"recompute.select_module[{pattern!r}]"
        regex = _compile_pattern(pattern, label)
        ids = list(range(layers.total)) if specs is None else _layers_of(specs, label, layers.total)
        targets = [d for d in layers.present(ids) if d.layer_id not in full_ids]
        matched_any = False
        for d in targets:
            for rel, module in _match_modules(d, regex, taken.setdefault(d.layer_id, set())):
                recompute_module(module, policy)
                taken[d.layer_id].add(rel)
                plan.selected_paths.append(f"{d.name}.{rel}")
                matched_any = True
        if targets and not matched_any and not _already_covered(targets, regex, taken):
            raise _no_match_error(label, pattern, targets)
        plan.select[pattern] = [d.layer_id for d in targets]


def _apply_comm(
    plan: ActivationPlan,
    layers: _ModelLayers,
    recompute_comm: RecomputeCommConfig,
    full_ids: set[int],
    has_comm_ops: bool,
) -> None:
    pairs = _module_specs(recompute_comm.select_module, "recompute_comm.select_module")
    if not pairs:
        raise ConfigError(
            "recompute_comm.select_module is required when recompute_comm.enable is true: a mapping "
            "{module pattern: [layer specs]}, e.g. {'self_attention': ['0-3']}"
        )
    resolved: list[tuple[DecoderLayer, str, nn.Module]] = []
    for pattern, specs in pairs:
        label = f"recompute_comm.select_module[{pattern!r}]"
        regex = _compile_pattern(pattern, label)
        ids = list(range(layers.total)) if specs is None else _layers_of(specs, label, layers.total)
        targets = layers.present(ids)
        found = [(d, rel, m) for d in targets for rel, m in _match_modules(d, regex)]
        if targets and not found:
            error = _no_match_error(label, pattern, targets)
            if has_comm_ops:
                raise error
            # Nothing would be applied anyway (e.g. the spec's own example 'attention.qkv' on one
            # device): say it, but do not refuse a setting that is a no-op here.
            warnings.warn(str(error), UserWarning, stacklevel=4)
        resolved.extend(found)
    if not has_comm_ops:
        plan.comm_note = "recompute_comm: no effect (no communication ops in the forward on this layout)"
        warnings.warn(
            "recompute_comm.enable is true, but this run has no communication ops inside the model's "
            "forward (no tensor, sequence, context or expert parallelism), so it has no effect",
            UserWarning,
            stacklevel=4,
        )
    else:
        applied = []
        for d, rel, module in resolved:
            if d.layer_id in full_ids or is_recomputed(module):
                continue  # already recomputed as a whole, collectives included
            recompute_module(module, _comm_recompute_policy)
            applied.append(f"{d.name}.{rel}")
        plan.comm_paths = applied
        plan.comm_note = f"recompute_comm: collectives re-run in backward in {len(applied)} module(s)"


def _apply_swap(
    plan: ActivationPlan, layers: _ModelLayers, swap: SwapConfig, full_ids: set[int], pipeline_parallel: int
) -> None:
    if pipeline_parallel > 1:
        raise ConfigError(
            "swap is not supported with pipeline parallel (swap.enable with pipeline_parallel > 1)"
        )
    prefetch = swap.default_prefetch
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 1 <= prefetch <= layers.total - 1:
        raise ConfigError(
            f"swap.default_prefetch must be an int in [1, {layers.total - 1}] (1 to the number of layers minus "
            f"one; the model has {layers.total} layers), got {prefetch!r}"
        )
    swapper = ActivationSwap(prefetch)
    layer_swap = swap.layer_swap
    op_swap = swap.op_swap
    if not layer_swap and not op_swap:
        warnings.warn(
            "swap.enable is true but neither swap.layer_swap nor swap.op_swap names anything to swap",
            UserWarning,
            stacklevel=4,
        )
    max_layer = -1
    if layer_swap:
        entries = layer_swap if isinstance(layer_swap, list) else [layer_swap]
        first = entries[0]
        if not isinstance(first, Mapping) or "layers" not in first:
            raise ConfigError(
                f"swap.layer_swap[0] must be a mapping {{layers: [layer specs]}}, got {first!r}"
            )
        if len(entries) > 1:
            warnings.warn(
                "swap.layer_swap: only the first entry is used (as in the original); "
                f"{len(entries) - 1} more ignored",
                UserWarning,
                stacklevel=4,
            )
        ids = _layers_of(first["layers"], "swap.layer_swap[0].layers", layers.total)
        max_layer = max(ids, default=-1)
        for d in layers.present(ids):
            swap_module(d.module, swapper, d.layer_id)
        plan.layer_swap = ids
    if op_swap:
        entries = op_swap if isinstance(op_swap, list) else [op_swap]
        swapped_layers = set(plan.layer_swap)
        for i, entry in enumerate(entries):
            label = f"swap.op_swap[{i}]"
            if not isinstance(entry, Mapping) or "op_name" not in entry or "layers" not in entry:
                raise ConfigError(
                    f"{label} must be a mapping {{op_name: <pattern>, layers: [specs]}}, got {entry!r}"
                )
            pattern = entry["op_name"]
            regex = _compile_pattern(pattern, f"{label}.op_name")
            ids = _layers_of(entry["layers"], f"{label}.layers", layers.total)
            max_layer = max([max_layer, *ids])
            targets = [d for d in layers.present(ids) if d.layer_id not in swapped_layers]
            found = [(d, rel, m) for d in targets for rel, m in _match_modules(d, regex)]
            if targets and not found:
                raise _no_match_error(f"{label}.op_name", pattern, targets)
            for d, rel, module in found:
                swap_module(module, swapper, d.layer_id)
                plan.swapped_paths.append(f"{d.name}.{rel}")
            plan.op_swap[str(pattern)] = ids
    if max_layer >= 0 and max_layer + prefetch >= layers.total:
        raise ConfigError(
            f"swap: the highest swapped layer ({max_layer}) plus swap.default_prefetch ({prefetch}) must be "
            f"less than the number of layers ({layers.total}); lower default_prefetch or swap earlier layers"
        )
    overlap = sorted(full_ids & (set(plan.layer_swap) | {i for v in plan.op_swap.values() for i in v}))
    if overlap:
        warnings.warn(
            f"swap on layers {_ranges(overlap)} has no effect: they are fully recomputed, so they keep no "
            "activations to swap",
            UserWarning,
            stacklevel=4,
        )
    plan.prefetch = prefetch
    plan.swapper = swapper
