"""Muon (Newton-Schulz orthogonalised momentum) with a built-in AdamW branch and QK-Clip.

Per Muon parameter (2-D weights, and 3-D expert stacks per expert), on the fp32 parameter:

    m <- momentum * m + g                        (sum-form momentum, fp32, as the original)
    u <- g + momentum * m   if nesterov else m
    pieces <- split(u) by the model's split schema (fused QKV, gate/up, MLA blocks)
    update <- concat(lr * matched_adamw_rms * sqrt(max(A, B)) * NS(piece))   (NS in bf16 by default)
    p <- p * (1 - lr * wd) - update

Pieces of the same shape (up to transposition) across all parameters are orthogonalised together
in batched matmuls. Every other parameter (1-D, embeddings and output layer by ``adamw_include``)
takes the AdamW branch with ``adamw_betas`` / ``adamw_eps``. After all updates, QK-Clip scales the
query/key rows of heads whose max logit exceeded the threshold, on the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.optim.adamw import adam_update, init_adam_state
from lmforge.optim.moment_dtype import narrow_
from lmforge.optim.muon_comm import MuonWork, compute_updates, whole_matrices_local
from lmforge.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, Schedule, Workspace, orthogonalize_into
from lmforge.optim.qk_clip import apply_qk_clip
from lmforge.optim.update_rule import UpdateRuleOptimizer, local
from lmforge.utils.logging import get_logger
from lmforge.utils.muon_split import MuonSplit, as_muon_split, split_pieces
from lmforge.utils.qk_clip import QKClipLayer

logger = get_logger("lmforge.optim")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def is_muon_shape(p: torch.Tensor) -> bool:
    return p.dim() in (2, 3)


def _split_by_route(params: Any) -> list[dict]:
    """Groups without a ``route`` are split into a Muon part (2-D/3-D) and an AdamW part."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        if "route" in g:
            out.append(g)
            continue
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        names = g.get("param_names")
        for route in ("muon", "adamw"):
            keep = [i for i, p in enumerate(ps) if is_muon_shape(p) == (route == "muon")]
            if keep:
                sub = {**g, "params": [ps[i] for i in keep], "route": route}
                if names is not None:
                    sub["param_names"] = [names[i] for i in keep]
                out.append(sub)
    return out


class Muon(UpdateRuleOptimizer):
    """Param groups carry ``route`` ("muon" or "adamw"); groups without it are routed by shape."""

    def __init__(
        self,
        params: Any,
        lr: float = 2e-2,
        weight_decay: float = 0.1,
        matched_adamw_rms: float = 0.2,
        momentum: float = 0.95,
        eps: float = 1e-7,
        nesterov: bool = True,
        ns_schedule: Schedule = (DEFAULT_NS_COEFFICIENTS,) * 5,
        adamw_betas: tuple[float, float] = (0.95, 0.95),
        adamw_eps: float = 1e-8,
        qk_clip_enabled: bool = True,
        qk_clip_threshold: float = 100.0,
        comm_strategy: str = "allgather",
        ns_dtype: str | torch.dtype = "bfloat16",
        *,
        model: nn.Module | None = None,
        split_schema: dict[str, MuonSplit | tuple[int, list[int]]] | None = None,
        qk_clip_group: dist.ProcessGroup | None = None,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            matched_adamw_rms=matched_adamw_rms,
            momentum=momentum,
            nesterov=nesterov,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
        )
        self.ns_schedule = tuple(tuple(float(c) for c in t) for t in ns_schedule)
        self.ns_eps = eps
        self.ns_dtype = _DTYPES[ns_dtype] if isinstance(ns_dtype, str) else ns_dtype
        self.comm_strategy = comm_strategy
        self.qk_clip_enabled = qk_clip_enabled
        self.qk_clip_threshold = qk_clip_threshold
        self.qk_clip_group = qk_clip_group
        self.model = model
        super().__init__(_split_by_route(params), defaults, model=model, moment_dtype=moment_dtype)

        self._names: dict[int, str] = {}
        for g in self.param_groups:
            for j, p in enumerate(g["params"]):
                names = g.get("param_names")
                if names:
                    self._names[id(p)] = names[j]
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._names.setdefault(id(p), name)
        self._by_name = {}
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in self._names:
                    self._by_name[self._names[id(p)]] = p
        if model is not None:
            for name, p in model.named_parameters(remove_duplicate=False):
                self._by_name.setdefault(name, p)
        if split_schema is None and model is not None and callable(getattr(model, "muon_split_schema", None)):
            split_schema = model.muon_split_schema()
        self.split_schema = {k: as_muon_split(v) for k, v in (split_schema or {}).items()}
        self._check_split_schema()
        self._pending: list[dict] = []
        self._workspace = Workspace()  # Newton-Schulz buffers reused across steps
        self._qk_layers = self._find_qk_layers()

    # -- set-up -------------------------------------------------------------------------------------
    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        group.setdefault("route", "muon" if is_muon_shape(p) else "adamw")
        if group["route"] == "muon":
            if not is_muon_shape(p):
                raise ValueError(f"Muon takes 2-D and 3-D weights only; got shape {tuple(p.shape)}")
            state["momentum_buffer"] = self._zeros_like(p)
            if self.moment_dtype != torch.float32:
                # Compressed momentum: a step count (checkpointed) picks the stochastic-rounding stream.
                state["step"] = self._step_counter(p)
        else:
            init_adam_state(self, p, state)

    def _check_split_schema(self) -> None:
        for g in self.param_groups:
            if g["route"] != "muon":
                continue
            for p in g["params"]:
                split = self.split_schema.get(self._names.get(id(p), ""))
                if split is None:
                    continue
                dim, sizes = split.dim, split.sizes
                if sum(sizes) != p.shape[dim]:
                    raise ValueError(
                        f"muon_split_schema of {self._names[id(p)]}: sizes {sizes} do not add up to dim {dim} "
                        f"of shape {tuple(p.shape)}"
                    )

    def _find_qk_layers(self) -> list[QKClipLayer]:
        if not self.qk_clip_enabled:
            return []
        fn = getattr(self.model, "qk_clip_layers", None)
        layers = list(fn()) if callable(fn) else []
        if not layers:
            logger.warning(
                "optimizer.qk_clip_enabled: the model does not expose qk_clip_layers(), so QK-Clip has no effect "
                "(set qk_clip_enabled: false to silence this)."
            )
            return []
        if any(layer.qk_norm for layer in layers):
            logger.warning(
                "optimizer.qk_clip_enabled: attention layers with QK-norm normalise q and k, so scaling their "
                "weights cannot bound the logits; QK-Clip skips those layers."
            )
        if hasattr(self.model, "track_max_logits"):
            self.model.track_max_logits = True
        return layers

    # -- the step -----------------------------------------------------------------------------------
    def _folds_grad_scale(self, group: dict) -> bool:
        return group["route"] != "muon"  # the AdamW groups (adam_update's fused kernel)

    def _update_group(self, group: dict) -> None:
        if group["route"] == "muon":
            self._pending.append(group)
            return
        adam_update(
            self,
            group["params"],
            lr=group["lr"],
            betas=group["adamw_betas"],
            eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )

    def _after_update(self) -> None:
        groups, self._pending = self._pending, []
        self._muon_update(groups)
        if self._qk_layers:
            apply_qk_clip(self._qk_layers, self.qk_clip_threshold, self._by_name.get, self.qk_clip_group)
            reset = getattr(self.model, "reset_max_logits", None)
            if callable(reset):
                reset()

    def _muon_update(self, groups: list[dict]) -> None:
        local_steps: list[_LocalStep] = []
        works: list[MuonWork] = []
        targets: list[tuple[torch.Tensor, dict]] = []
        for group in groups:
            mu = group["momentum"]
            for p in group["params"]:
                g = self._grad(p)
                # One rank holding the whole matrix (FSDP2 over one process) needs no collective.
                sharded = isinstance(p, DTensor) and p.device_mesh.size() > 1
                if g is None:
                    if not sharded:
                        continue
                    # Sharded: every rank must take part in the same collectives, so a missing grad is zero.
                    g = torch.zeros_like(p)
                stored = local(self.state[p]["momentum_buffer"])
                m = stored.float() if stored.dtype != torch.float32 else stored  # compressed: fp32 math
                g = local(g)
                m.mul_(mu).add_(g)
                if m is not stored:
                    counter = self.state[p]["step"]
                    counter.add_(1)
                    narrow_([stored], [m], int(counter.item()), [3 * self.param_index(p)])
                work = MuonWork(
                    u=m,  # replaced below: the Nesterov sum in the Newton-Schulz dtype
                    layout=p if sharded else None,
                    split=self.split_schema.get(self._names.get(id(p), "")),
                    lr_rms=group["lr"] * group["matched_adamw_rms"],
                )
                nesterov = group["nesterov"]
                if whole_matrices_local(work):
                    local_steps.append(_LocalStep(p, group, g, m, mu if nesterov else None, work))
                    continue
                work.u = (g.add(m, alpha=mu) if nesterov else m).to(self.ns_dtype)
                works.append(work)
                targets.append((p, group))
        if local_steps:
            self._local_update(local_steps)
        if not works:
            return
        updates = compute_updates(works, self.comm_strategy, self.ns_schedule, self.ns_eps, self.ns_dtype)
        for (p, group), up in zip(targets, updates):
            w = local(p)
            if group["weight_decay"] != 0:
                w.mul_(1.0 - group["lr"] * group["weight_decay"])
            w.sub_(up)

    def _local_update(self, steps: list[_LocalStep]) -> None:
        """Parameters whose whole matrices are on this rank: the Nesterov sum is written (cast) straight
        into the Newton-Schulz buffers, orthogonalised in place, and each piece's scaled update is
        subtracted from its rows of the parameter. Same arithmetic per element as the sharded path
        (``w * (1 - lr wd) - fp32(O) * scale``), so both give the same bits."""
        shapes: list[torch.Size] = []
        fills: list[tuple[_LocalStep, int]] = []
        for st in steps:
            if st.work.split is None:
                shapes.append(st.m.shape)
                fills.append((st, -1))
                continue
            u = st.m if st.mu is None else st.g.add(st.m, alpha=st.mu)
            st.pieces = split_pieces(u, st.work.split)
            for j, piece in enumerate(st.pieces):
                shapes.append(piece.shape)
                fills.append((st, j))

        def fill(i: int, slot: torch.Tensor) -> None:
            st, j = fills[i]
            if j >= 0:
                slot.copy_(st.pieces[j])
            elif st.mu is None:
                slot.copy_(st.m)
            elif slot.dtype == st.m.dtype:
                torch.add(st.g, st.m, alpha=st.mu, out=slot)
            else:
                # fp32 sum into a kept scratch, then the cast: add(out=bf16) would allocate (and on a
                # CPU page-fault) a fresh fp32 temporary per parameter.
                u = self._workspace.get("nesterov", tuple(slot.shape), st.m.dtype, slot.device)
                slot.copy_(torch.add(st.g, st.m, alpha=st.mu, out=u))

        device = steps[0].m.device
        ortho = orthogonalize_into(
            shapes, fill, self.ns_schedule, self.ns_eps, self.ns_dtype, device, self._workspace
        )
        k = 0
        for st in steps:
            w = local(st.p)
            group = st.group
            if group["weight_decay"] != 0:
                w.mul_(1.0 - group["lr"] * group["weight_decay"])
            split = st.work.split
            n = 1 if split is None else len(split.sizes)
            offset = 0
            for j in range(n):
                o = ortho[k + j]
                up = self._workspace.get("update", tuple(o.shape), torch.float32, o.device)
                up.copy_(o).mul_(st.work.lr_rms * math.sqrt(max(o.shape[-2], o.shape[-1])))
                if split is None:
                    w.sub_(up)
                    continue
                size = split.sizes[j]
                if split.order is None:
                    w.narrow(split.dim, offset, size).sub_(up)
                else:
                    rows = split.order[offset : offset + size].to(w.device)
                    w.index_add_(split.dim, rows, up, alpha=-1)  # w[rows] - up, exactly
                offset += size
            k += n
            st.pieces = None


@dataclass
class _LocalStep:
    """One parameter on the local path: its fp32 gradient and momentum, ``mu`` for Nesterov (None: plain)."""

    p: torch.Tensor
    group: dict
    g: torch.Tensor
    m: torch.Tensor
    mu: float | None
    work: MuonWork
    pieces: list[torch.Tensor] | None = None
