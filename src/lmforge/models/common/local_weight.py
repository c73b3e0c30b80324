"""The local view of a weight that a computation on this rank's own tokens reads (routers, routed experts).

Under tensor or expert parallel such weights stay DTensor parameters (FSDP, checkpoints, clipping and the
optimizers see their placements); the module's own forward calls :func:`local_weight` for the plain tensor
it multiplies, as torchtitan's grouped experts do. Nothing swaps tensors into the module from outside.

The gradient rule follows from the placements. A mesh dimension where the weight is ``Shard`` (expert
parallel's experts) keeps this rank's block. A mesh dimension where it is ``Replicate`` (a router under
tensor parallel, the expert shard replicated over tp) means every rank there holds the same weight but
applies it to different tokens: the local gradient is a ``Partial`` summand, and DTensor's redistribution
back to the parameter's placements is the all-reduce. No hand-written autograd collective.
"""

from __future__ import annotations

import torch


def local_weight(param: torch.Tensor) -> torch.Tensor:
    """``param`` itself when it is a plain tensor; for a DTensor, its local block as a plain tensor whose
    gradient is summed over the mesh dimensions where ``param`` is replicated."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(param, DTensor):
        return param
    placements = tuple(param.placements)
    if not any(isinstance(p, Replicate) for p in placements):
        return param.to_local()
    grad_placements = tuple(Partial() if isinstance(p, Replicate) else p for p in placements)
    # to_local's backward wraps the incoming local gradient as ``grad_placements``; from_local's backward
    # redistributes that to ``placements`` (the all-reduce over the replicated dimensions) for the parameter,
    # whose gradient so keeps its own placements (a Partial gradient would reach FSDP and the optimizer).
    view = DTensor.from_local(param.to_local(), param.device_mesh, placements, run_check=False)
    return view.to_local(grad_placements=grad_placements)
