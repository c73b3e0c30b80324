"""FSDP2 (``fully_shard``) per decoder layer and the root, from the ``parallelism`` section.

Numerics (DESIGN §6): the sharded parameters are kept in fp32 and are the master weights; each layer
is gathered in ``compute_dtype`` for its forward and backward (``MixedPrecisionPolicy.param_dtype``),
and gradients are reduce-scattered and accumulated in fp32 (``reduce_dtype``). The optimizer therefore
sees fp32 parameters and keeps no second master copy.

``data_parallel_shard_strategy`` (the ZeRO stage of the original's HyperParallel FSDP):

* ``optim_grads_params`` (ZeRO-3): parameters resharded after forward, per
  ``reshard_after_forward_policy``.
* ``optim_grads`` (ZeRO-2): parameters stay gathered from forward to backward (one all-gather per
  step instead of two); gradients and optimizer states sharded.
* ``optim`` (ZeRO-1): FSDP2 always shards gradients, so this runs as ``optim_grads``: the same
  numbers, less memory than asked for. Documented as "lifted".

One process (or a shard group of one) is wrapped the same way: the parameters stay fp32, each layer's
compute copy is cast from them. There, with a 16-bit ``compute_dtype``, the ``default`` policy keeps the
compute copies from forward to backward (resharding would only cast every layer again in backward; the
memory is that of the former bf16 parameters); in fp32 the copy would double the parameters' memory, so
layers are resharded as usual. The gradient divide factor is left alone (nothing is reduced; setting it
would cost a division pass over every gradient). Modules whose shard group is one rank get a gradient
reduction that moves nothing (``fsdp_one_rank.py``): no copy of the fp32 gradients between the
reduce-scatter buffers. (FSDP2 itself skips the all-gather there and casts each parameter into its
compute copy.)

Units at one rank. Where nothing is sharded and the 16-bit compute copies are kept, an FSDP unit per layer buys
nothing (no all-gather to overlap, nothing to free after forward) and costs Python hooks around every
layer's forward and backward: 5-9% of a step of the demo model on a CPU. There consecutive layers are
grouped into one unit (:func:`fsdp_units`) up to :data:`ONE_RANK_UNIT_PARAMS` parameters, and a model
no larger than that is a single unit. The price is memory: a unit's 16-bit gradients stay alive until
its reduction, up to 2 bytes per parameter of the largest unit at the end of backward (the memory
estimate counts them). Layers larger than the bound keep a unit each, as on several ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmforge.config.sections_parallel import ParallelismConfig
from lmforge.models.common.layers import layer_modules
from lmforge.parallel.fsdp_one_rank import use_one_rank_comms

# The most parameters one FSDP unit groups at one rank (see the module docstring): 2**25 (~34M)
# parameters, whose bf16 gradients are 64 MiB. On a CPU a unit's hooks cost ~2-3 ms per step, under 1%
# of the compute of a unit this size at 2k tokens per step.
ONE_RANK_UNIT_PARAMS = 1 << 25


def _reshard_after_forward(
    section: ParallelismConfig, shard_size: int = 2, low_precision: bool = False
) -> bool | None:
    policy = section.reshard_after_forward_policy
    strategy = section.data_parallel_shard_strategy
    if policy == "always":
        return True
    if policy == "never":
        return False
    # "default": ZeRO-3 reshards every layer but the root (FSDP2's own default); ZeRO-1/2 keep them,
    # and so does a shard group of one rank computing in 16 bits (see the module docstring).
    keep = strategy != "optim_grads_params" or (shard_size == 1 and low_precision)
    return False if keep else None


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    section: ParallelismConfig,
    *,
    compute_dtype: torch.dtype,
    expert_mesh: Any = None,
    layers: list[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D FSDP or 2-D HSDP) and return it."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    reshard = _reshard_after_forward(section, _shard_size(mesh), compute_dtype != torch.float32)
    # Storage in fp32 (the masters); compute in compute_dtype; reductions in fp32.
    model.to(torch.float32)
    # No input casting: the hidden states are already in compute_dtype (the embedding runs in it), and
    # the fp32 side inputs (RoPE cos/sin, the model's rotary_dtype) must stay fp32.
    mp = MixedPrecisionPolicy(
        param_dtype=compute_dtype if compute_dtype != torch.float32 else None,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )
    offload = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if section.cpu_offload else OffloadPolicy()
    )
    common = {"mp_policy": mp, "offload_policy": offload}
    fp32_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
    expert_modules: list[nn.Module] = []
    layers = layer_modules(model) if layers is None else layers
    for layer in layers:
        for sub in layer.modules():
            if getattr(sub, "keep_fp32", False) and compute_dtype != torch.float32:
                # Routers compute in fp32 (the original's router_dense_type): their own group, no cast.
                fully_shard(
                    sub, mesh=mesh, reshard_after_forward=reshard, mp_policy=fp32_mp, offload_policy=offload
                )
        experts = _routed_experts(layer)
        if experts is not None and expert_mesh is not None:
            # Experts are already split over ep; shard the rest of their parameters over the remaining ranks.
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard, **common)
            expert_modules.append(experts)
    # Grouped only where the 16-bit compute copies are kept anyway (module docstring); in fp32 a group
    # would also keep fp32 copies and gradients of several layers at once.
    one_rank_kept = _shard_size(mesh) == 1 and reshard is False and compute_dtype != torch.float32
    for unit in fsdp_units(model, layers, group=one_rank_kept):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard, **common)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **common)
    # Where a module's shard group is one rank, its reduce-scatter moves nothing: skip FSDP2's copy
    # between its buffers (parallel/fsdp_one_rank.py).
    experts_one_rank = expert_mesh is not None and _shard_size(expert_mesh) == 1
    use_one_rank_comms(
        [
            m
            for m in model.modules()
            if isinstance(m, FSDPModule)
            and (experts_one_rank if any(m is e for e in expert_modules) else _shard_size(mesh) == 1)
        ]
    )
    # Reduce with SUM whatever disable_gradient_division says: the loss each rank backpropagates is
    # already divided by the global token count (DESIGN §6), so a second division would be wrong.
    if mesh.size() == 1:
        return model  # nothing is reduced (see the module docstring)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def group_sizes(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (parameters per layer) grouped greedily into runs of at most
    ``limit`` parameters; a layer larger than ``limit`` is a run of its own."""
    runs: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if runs and total + n <= limit:
            runs[-1].append(i)
            total += n
        else:
            runs.append([i])
            total = n
    return runs


def fsdp_units(model: nn.Module, layers: list[nn.Module], *, group: bool) -> list[list[nn.Module]]:
    """The FSDP units below the root, in order: a layer each, or with ``group`` (one rank, compute copies
    kept) runs of consecutive layers up to :data:`ONE_RANK_UNIT_PARAMS` parameters, and none at all when
    the whole model is within that bound (the root unit then holds everything)."""
    if not group:
        return [[layer] for layer in layers]
    if sum(_local_numel(p) for p in model.parameters()) <= ONE_RANK_UNIT_PARAMS:
        return []
    sizes = [sum(_local_numel(p) for p in layer.parameters()) for layer in layers]
    return [[layers[i] for i in run] for run in group_sizes(sizes, ONE_RANK_UNIT_PARAMS)]


def _local_numel(p: torch.Tensor) -> int:
    # A tensor-parallel parameter is already a DTensor here; numel() would count all its shards.
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _shard_size(mesh: Any) -> int:
    return mesh.size(mesh.ndim - 1)


def _routed_experts(layer: nn.Module) -> nn.Module | None:
    from lmforge.models.common.moe import moe_layers

    found = moe_layers(layer)
    return found[0].experts if found else None
