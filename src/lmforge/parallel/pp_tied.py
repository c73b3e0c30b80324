"""Tied word embeddings under pipeline parallel: the output layer of the last stage is the embedding.

The parameter lives only on the first stage (one name, one optimizer state, counted once by the
gradient norm, saved once). :class:`TiedOutput` is the module that carries it to the last stage: before
the schedule runs, the first stage sends the full weight to the last stage of the same data/context
coordinate, where ``TiedOutput.weight`` is a leaf that the last ``StageModule`` multiplies for its
logits; after the schedule, the last stage sends that leaf's gradient back and the first stage adds it
to the parameter's, summed over its data and context ranks and sliced like the parameter (a
``Partial`` → parameter-placement redistribution). Both transfers are called explicitly by the
pipeline around ``schedule.step``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def pair_groups(world_mesh: Any) -> Any:
    """The (first stage, last stage) group of this rank's coordinate, or None on middle stages.

    Every rank creates every pair group, in the same order (``new_group`` is collective).
    """
    ranks = world_mesh.mesh  # [pp, dp_replicate, dp_shard, cp, tp] global ranks
    pp = ranks.shape[0]
    me = dist.get_rank()
    mine = None
    flat_first = ranks[0].reshape(-1).tolist()
    flat_last = ranks[pp - 1].reshape(-1).tolist()
    for first, last in zip(flat_first, flat_last):
        group = dist.new_group([first, last])
        if me in (first, last):
            mine = group
    return mine


class TiedOutput(nn.Module):
    """Moves the tied weight to the last stage and its gradient back, around one pipeline step.

    On the last stage it is a submodule of the last ``StageModule``; it holds no parameter (the
    weight is the first stage's), only this step's received copy.
    """

    def __init__(
        self, model: nn.Module, group: Any, is_first: bool, is_last: bool, compute_dtype: torch.dtype
    ):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: the embedding keeps one name
        self.group = group
        self.is_first, self.is_last = is_first, is_last
        self.compute_dtype = compute_dtype
        self.weight: torch.Tensor | None = None  # the last stage's leaf copy (fp32)
        self._shape = (model.config.vocab_size, model.config.hidden_size)

    def _param(self) -> Any:
        return self._model.embedding.word_embeddings.weight

    def send_weight(self, requires_grad: bool) -> None:
        if self.group is None:
            return
        if self.is_first:
            full = self._param().full_tensor().detach().float().contiguous()  # collective in the stage
            dist.send(full, group_dst=1, group=self.group)
        if self.is_last:
            buf = torch.empty(self._shape, dtype=torch.float32, device=self._device())
            dist.recv(buf, group_src=0, group=self.group)
            self.weight = buf.requires_grad_(requires_grad)

    def return_grad(self) -> None:
        from torch.distributed.tensor import DTensor, Partial

        if self.group is None:
            return
        if self.is_last:
            grad = self.weight.grad if self.weight.grad is not None else torch.zeros_like(self.weight)
            dist.send(grad.contiguous(), group_dst=0, group=self.group)
            self.weight = None
        if self.is_first:
            p = self._param()
            local = torch.empty(tuple(p.shape), dtype=torch.float32, device=p.to_local().device)
            dist.recv(local, group_src=1, group=self.group)
            # Each data/context rank's last stage saw different tokens: sum them, slice like the weight.
            mesh = p.device_mesh
            partial = DTensor.from_local(local, mesh, [Partial()] * mesh.ndim, run_check=False)
            part = partial.redistribute(mesh, p.placements).to_local()
            if p.grad is None:
                p.grad = DTensor.from_local(part.to(p.dtype), mesh, p.placements, run_check=False)
            else:
                p.grad.to_local().add_(part.to(p.grad.dtype))

    def _device(self) -> torch.device:
        buffers = list(self._model.buffers())
        return buffers[0].device if buffers else torch.device("cpu")
