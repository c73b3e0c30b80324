"""A replicated DTensor parameter read as a plain local tensor by a computation that sees only this rank's
tokens or heads (routers, routed experts, the hand-written blocks' adapters): its gradient is a partial sum.

DTensor states this directly: the local gradient is declared ``Partial`` on the mesh dimension where the
parameter is replicated, and the redistribution back to the parameter's placements (``Partial`` →
``Replicate``) is the all-reduce. No hand-written autograd collective.
"""

from __future__ import annotations

from typing import Any

import torch


def local_summing_grad(param: Any, mesh_dim_name: str = "tp") -> torch.Tensor:
    """``param``'s local block as a plain tensor whose gradient is summed over its mesh's ``mesh_dim_name``.

    ``param`` must be ``Replicate`` on that dimension (its other placements, e.g. expert parallel's
    ``Shard(0)``, are kept). The parameter's own gradient keeps its placements, so FSDP, gradient clipping
    and the optimizers see an ordinary replicated gradient.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    names = param.device_mesh.mesh_dim_names or ()
    if mesh_dim_name not in names:
        raise ValueError(f"expected a parameter on a mesh with a {mesh_dim_name!r} dimension, got {names}")
    mesh_dim = names.index(mesh_dim_name)
    placements = tuple(param.placements)
    if not isinstance(placements[mesh_dim], Replicate):
        raise ValueError(f"expected a parameter replicated on mesh dimension {mesh_dim}, got {placements}")
    grad_placements = tuple(Partial() if i == mesh_dim else p for i, p in enumerate(placements))
    # to_local's backward wraps the incoming local gradient as ``grad_placements``; from_local's backward
    # redistributes that to ``placements`` (the all-reduce over ``mesh_dim``) and hands it to the parameter.
    view = DTensor.from_local(param.to_local(), param.device_mesh, placements, run_check=False)
    return view.to_local(grad_placements=grad_placements)
