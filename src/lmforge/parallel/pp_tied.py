"""The word embedding on the last pipeline stage: tied output layer and multi-token prediction.

The last stage needs the embedding weight in two cases: tied word embeddings (the output layer *is* the
embedding) and multi-token prediction (each MTP depth looks up the embeddings of the shifted tokens).
The parameter lives only on the first stage (one name, one optimizer state, counted once by the
gradient norm, saved once, so checkpoints load into any layout). :class:`LastStageEmbedding` is the
module that carries it to the last stage: before the schedule runs, the first stage sends the full
weight to the last stage of the same data/context/tensor coordinate, where
``LastStageEmbedding.weight`` is a leaf that the last ``StageModule`` multiplies for its logits (tied)
and looks the MTP tokens up in; after the schedule, the last stage sends that leaf's gradient back and
the first stage adds it to the parameter's, summed over its data, context and tensor ranks and sliced
like the parameter (a ``Partial`` → parameter-placement redistribution). Both transfers are called
explicitly by the pipeline around ``schedule.step``.

Why a carried weight and not a second copy of the embedding on the last stage kept in sync (Megatron's
and the original's "shared embedding"): a copy is a second parameter under the same name, which the
optimizer would update and the gradient norm count twice and a checkpoint save twice (on different
meshes), and which would have to be re-synced after every load. Carrying the weight keeps one
parameter; its cost is one ``[vocab, hidden]`` transfer each way per step, the volume a synced copy
spends on its gradient all-reduce plus one more for the weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


class LastStageEmbedding(nn.Module):
    """Moves the embedding weight to the last stage and its gradient back, around one pipeline step.

    On the last stage it is a submodule of the last ``StageModule``; it holds no parameter (the
    weight is the first stage's), only this step's received copy. ``tied``: the last stage's output
    layer is this weight (:meth:`output_weight`); multi-token prediction looks tokens up in it
    (:meth:`lookup`). ``tp_rank`` / ``tp_size``: sequence parallel, where a lookup returns this tensor-
    parallel rank's slice of the sequence (as the vocabulary-parallel embedding of the first stage does).
    """

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        is_first: bool,
        is_last: bool,
        compute_dtype: torch.dtype,
        *,
        tied: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: the embedding keeps one name
        self.group = group
        self.is_first, self.is_last = is_first, is_last
        self.compute_dtype = compute_dtype
        self.tied = tied
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight: torch.Tensor | None = None  # the last stage's leaf copy (fp32)
        self._shape = (model.config.vocab_size, model.config.hidden_size)

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight (tied embeddings), in the compute dtype as FSDP would gather it."""
        return self.weight.to(self.compute_dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``ids`` ``[B, S]`` in the compute dtype; this tp rank's ``S / tp`` positions under
        sequence parallel. The gradient reaches the carried leaf, and from there the first stage."""
        if self.tp_size > 1:
            s = ids.shape[1] // self.tp_size
            ids = ids[:, self.tp_rank * s : (self.tp_rank + 1) * s]
        return F.embedding(ids, self.weight.to(self.compute_dtype))

    def _param(self) -> Any:
        return self._model.embedding.word_embeddings.weight

    def send_weight(self, requires_grad: bool) -> None:
        if self.group is None:
            return
        if self.is_first:
            from torch.distributed.tensor import DTensor

            p = self._param()
            # FSDP2 leaves a root group unsharded after a forward without backward (evaluation): then the
            # parameter is the whole weight already (a plain tensor, or under tp a DTensor over tp only).
            full = p.full_tensor() if isinstance(p, DTensor) else p  # (full_tensor: collective in the stage)
            full = full.detach().float().contiguous()
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
            # Each data/context/tensor rank's last stage saw different tokens: sum them, slice like the weight.
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
