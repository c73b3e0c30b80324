"""Context parallel: each of the cp ranks holds two of ``2·cp`` sequence chunks (load-balanced causal).

Rank r keeps chunks ``r`` and ``2·cp-1-r``, so every rank has the same amount of causal attention work.
Two attention methods, both plain collectives, so they run on gloo/CPU as well as NCCL:

* ``colossal`` (the default name of the original; here: all-gather KV). Keys and values are gathered
  from all cp ranks and the local queries attend to them with a mask from the global positions. The
  result equals full attention; memory for K/V is that of the whole sequence. (torch's ring-attention
  CP supports only CUDA SDPA kernels, see reference/torch_cpu.md.)
* ``ulysses`` (``ulysses_degree_in_cp == context_parallel``). An all-to-all trades the sequence split
  for a head split, each rank runs causal attention over the whole sequence for ``H/cp`` heads, and a
  second all-to-all returns to sequence shards.
* hybrid (``1 < ulysses_degree_in_cp = u < context_parallel``): Ulysses inside groups of ``u``
  neighbouring cp ranks, then K/V gathered across the ``cp/u`` groups.

The model sees its local tokens only; positions come from ``position_ids`` (created as ``arange`` when
the batch has none), so rotary embeddings stay correct. A document mask (``attention_mask`` or
``actual_seq_len``) is taken out of the batch and applied, for the whole sequence, by global positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError, DataError
from lmforge.models.common.attention import CoreAttention, segment_attention
from lmforge.models.common.masks import DocumentSegments, attention_layout

SEQUENCE_KEYS = ("input_ids", "labels", "loss_mask", "position_ids")


def chunk_order(cp: int) -> list[int]:
    """Global chunk ids in the order they sit when the ranks' local sequences are concatenated."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def local_positions(seq_local: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """Global position of each local token (the two chunks of ``rank``)."""
    c = seq_local // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


class DocumentMask:
    """The whole-sequence document layout of the current micro-batch (document masking under cp).

    The model builds its mask from its (local) inputs; under context parallel the batch's document
    mask is taken out before the model and kept here, for the attention to apply by global positions.
    ``layout`` is what :func:`~lmforge.models.common.masks.attention_layout` gives for the whole
    sequence: None (plain causal), ``DocumentSegments`` (``actual_seq_len``: O(S) spans) or, for an
    explicit ``attention_mask`` only, the dense ``[B or 1, 1, S, S]`` may-attend mask. One micro-batch
    at a time (its backward, recompute included, follows its forward).
    """

    def __init__(self) -> None:
        self.layout: torch.Tensor | DocumentSegments | None = None


def shard_batch(
    batch: dict[str, torch.Tensor], cp: int, rank: int, doc_mask: DocumentMask | None = None
) -> dict[str, torch.Tensor]:
    """This rank's two chunks of every sequence tensor; adds ``position_ids`` when missing.

    A document mask (``attention_mask`` / ``actual_seq_len``) is removed from the batch and stored,
    for the whole sequence, in ``doc_mask``.
    """
    if cp == 1:
        return batch
    ids = batch["input_ids"]
    seq = ids.shape[1]
    if seq % (2 * cp):
        raise ConfigError(
            f"the sequence length {seq} must be divisible by 2 × parallelism.context_parallel = {2 * cp}."
        )
    out = dict(batch)
    has_doc_mask = any(out.get(k) is not None for k in ("attention_mask", "actual_seq_len"))
    if has_doc_mask and doc_mask is None:
        raise DataError(
            "the batch has a document mask (attention_mask / actual_seq_len), which context parallel does not "
            "support together with pipeline parallel; drop the document mask from the dataloader's column_names "
            "or use one of them."
        )
    if doc_mask is not None:
        doc_mask.layout = attention_layout(
            seq, ids.device, out.pop("attention_mask", None), out.pop("actual_seq_len", None)
        )
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq, device=ids.device).expand_as(ids)
    c = seq // (2 * cp)
    for key in SEQUENCE_KEYS:
        t = out.get(key)
        if t is None:
            continue
        chunks = t.split(c, dim=1)
        out[key] = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1).contiguous()
    return out


def natural_order_index(cp: int, chunk_len: int, device: torch.device) -> torch.Tensor:
    """Index that puts a sequence gathered in :func:`chunk_order` back in natural (position) order."""
    order = chunk_order(cp)
    inverse = torch.tensor(sorted(range(2 * cp), key=lambda p: order[p]), device=device)
    return (inverse[:, None] * chunk_len + torch.arange(chunk_len, device=device)[None]).flatten()


def lower_right_causal_attention(q, k, v, scale: float, dropout: float, gqa: bool) -> torch.Tensor:
    """Queries that are the last ``Lq`` of ``Lk`` key positions, each attending to the keys up to its own.

    SDPA's ``is_causal`` aligns the triangle top-left (query i sees keys ``<= i``); here it is aligned
    bottom-right (query i sees keys ``<= i + Lk - Lq``). No ``Lq × Lk`` mask is built: with the queries
    in reverse order, query i' may see key j iff ``i' + j <= Lk - 1``, so the additive mask is a
    ``(1, 1)``-strided view of one vector of ``Lq + Lk - 1`` entries (O(S) memory, kept by autograd as is).
    """
    lq, lk = q.shape[2], k.shape[2]
    if lq == lk:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa
        )
    bias = torch.zeros(lq + lk - 1, dtype=q.dtype, device=q.device)
    bias[lk:] = float("-inf")
    mask = bias.as_strided((lq, lk), (1, 1))
    out = F.scaled_dot_product_attention(
        q.flip(2), k, v, attn_mask=mask, scale=scale, dropout_p=dropout, enable_gqa=gqa
    )
    return out.flip(2)


@torch.compiler.disable
def chunk_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[int],
    segments: DocumentSegments,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention inside each document for queries of some sequence chunks; O(S) extra memory.

    ``q`` ``[B, Hq, n·c, D]`` holds the global chunks ``chunks`` (``c`` positions each) in that order;
    ``k``, ``v`` ``[B, Hkv, S, D]`` the whole sequence in natural order. Every (chunk, document) piece
    is one SDPA call: the chunk's queries ``[qs, qe)`` of the document starting at ``a`` attend the keys
    ``[a, qe)``, causally (:func:`lower_right_causal_attention`). Excluded from ``torch.compile``
    graphs: the spans are Python integers that change every batch.
    """
    c = q.shape[2] // len(chunks)
    gqa = q.shape[1] != k.shape[1]

    def attend(rows: slice, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
        parts = []
        for i, g in enumerate(chunks):
            lo, hi = g * c, (g + 1) * c
            for a, b in spans:  # sorted and covering [0, S): the pieces come out in the chunk's order
                if b <= lo or a >= hi:
                    continue
                qs, qe = max(a, lo), min(b, hi)
                q_piece = q[rows, :, i * c + qs - lo : i * c + qe - lo]
                parts.append(
                    lower_right_causal_attention(
                        q_piece, k[rows, :, a:qe], v[rows, :, a:qe], scale, dropout, gqa
                    )
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    if len(segments.spans) == 1:
        return attend(slice(None), segments.spans[0])
    return torch.cat([attend(slice(i, i + 1), segments.row(i)) for i in range(q.shape[0])], dim=0)


def _document_allowed(segments: DocumentSegments, pos_q: torch.Tensor) -> torch.Tensor:
    """May-attend mask ``[B or 1, 1, Sq, S]`` of queries at ``pos_q`` over the natural-order keys.

    Only for max-logit tracking, which materialises the ``Sq × S`` logits anyway.
    """
    ids = segments.ids(pos_q.device)
    pos_k = torch.arange(segments.seq_len, device=pos_q.device)
    same = ids[:, pos_q][:, :, None] == ids[:, None, :]
    return (same & (pos_q[:, None] >= pos_k[None, :]))[:, None]


def _whole_sequence(seq_len: int) -> DocumentSegments:
    return DocumentSegments((((0, seq_len),),), seq_len)


def _attend_chunks(core: nn.Module, q, k_all, v_all, chunks: list[int], cp: int, doc, head_offset: int):
    """Local query chunks against K/V gathered from all cp ranks (in :func:`chunk_order`)."""
    c = q.shape[2] // len(chunks)
    pos_q = torch.cat([torch.arange(g * c, (g + 1) * c, device=q.device) for g in chunks])
    dropout = core.dropout if core.training else 0.0
    if isinstance(doc, torch.Tensor):
        # The explicit attention_mask form: the dense [B or 1, 1, S, S] mask, indexed by global positions.
        pos_k = torch.cat([local_positions(2 * c, cp, r, q.device) for r in range(cp)])
        allowed = doc.index_select(2, pos_q).index_select(3, pos_k)
        if getattr(core, "track_max_logits", False):
            track_max_logits(core, q, k_all, allowed, core.scale, head_offset=head_offset)
        return F.scaled_dot_product_attention(
            q,
            k_all,
            v_all,
            attn_mask=allowed,
            scale=core.scale,
            dropout_p=dropout,
            enable_gqa=q.shape[1] != k_all.shape[1],
        )
    natural = natural_order_index(cp, c, q.device)
    k_nat, v_nat = k_all.index_select(2, natural), v_all.index_select(2, natural)
    segments = doc if doc is not None else _whole_sequence(k_nat.shape[2])
    if getattr(core, "track_max_logits", False):
        track_max_logits(
            core, q, k_nat, _document_allowed(segments, pos_q), core.scale, head_offset=head_offset
        )
    return chunk_document_attention(q, k_nat, v_nat, chunks, segments, core.scale, dropout)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """Split ``scatter_dim`` in world chunks, send chunk j to rank j, concatenate what arrives on ``gather_dim``.

    torch's autograd-aware ``all_to_all_single`` on the chunks stacked along a new leading dimension; its
    backward is the reverse all-to-all.
    """
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim))
    received = funcol.all_to_all_single_autograd(send, None, None, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def _attend_gathered_kv(core: nn.Module, q, k, v, group, cp: int, rank: int, doc=None) -> torch.Tensor:
    k_all = funcol.all_gather_single_autograd(k.contiguous(), 2, group)
    v_all = funcol.all_gather_single_autograd(v.contiguous(), 2, group)
    chunks = [rank, 2 * cp - 1 - rank]
    return _attend_chunks(core, q, k_all, v_all, chunks, cp, doc, getattr(core, "head_offset", 0))


def _attend_ulysses(core: nn.Module, q, k, v, group, cp: int, rank: int, doc=None) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hkv % cp:
        # Fewer KV heads than ranks: give every query head its own copy before splitting heads.
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    # gathered position p*c + i holds global chunk order[p]; the index sorts back to natural order.
    index = natural_order_index(cp, q.shape[2] // 2, q.device)
    back = torch.argsort(index)
    qf, kf, vf = (_all_to_all(t, 1, 2, group).index_select(2, index) for t in (q, k, v))
    # Natural order here: the whole sequence for H/cp heads, exactly as on one process.
    if getattr(core, "track_max_logits", False):
        seq = qf.shape[2]
        if isinstance(doc, DocumentSegments):
            allowed = doc.dense(q.device)
        elif doc is None:
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        else:
            allowed = doc
        heads = qf.shape[1]
        track_max_logits(
            core, qf, kf, allowed, core.scale, head_offset=getattr(core, "head_offset", 0) + rank * heads
        )
    dropout = core.dropout if core.training else 0.0
    gqa = qf.shape[1] != kf.shape[1]
    if isinstance(doc, DocumentSegments):
        out = segment_attention(qf, kf, vf, doc, core.scale, dropout)
    elif doc is not None:
        out = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=doc, scale=core.scale, dropout_p=dropout, enable_gqa=gqa
        )
    else:
        out = F.scaled_dot_product_attention(
            qf, kf, vf, is_causal=True, scale=core.scale, dropout_p=dropout, enable_gqa=gqa
        )
    return _all_to_all(out.index_select(2, back), 2, 1, group)


def _attend_hybrid(core: nn.Module, q, k, v, groups, cp: int, rank: int, doc=None) -> torch.Tensor:
    """Ulysses inside groups of ``u`` cp ranks, K/V gathered across the ``cp/u`` groups.

    cp rank ``a·u + j``: ``a`` indexes the Ulysses group, ``j`` the rank inside it.
    """
    uly_group, ring_group = groups
    u = dist.get_world_size(uly_group)
    a, j = divmod(rank, u)
    hq, hkv = q.shape[1], k.shape[1]
    if hkv % u:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    qf, kf, vf = (_all_to_all(t, 1, 2, uly_group) for t in (q, k, v))
    k_all = funcol.all_gather_single_autograd(kf.contiguous(), 2, ring_group)
    v_all = funcol.all_gather_single_autograd(vf.contiguous(), 2, ring_group)
    # The group's queries: the two chunks of each of its u ranks, in rank order.
    chunks = [g for r in range(a * u, (a + 1) * u) for g in (r, 2 * cp - 1 - r)]
    offset = getattr(core, "head_offset", 0) + j * qf.shape[1]
    out = _attend_chunks(core, qf, k_all, v_all, chunks, cp, doc, offset)
    return _all_to_all(out, 2, 1, uly_group)


@torch.no_grad()
def track_max_logits(core: nn.Module, q, k, allowed, scale, head_offset: int = 0) -> None:
    """Running per-head max of the masked logits, written at the heads' global positions."""
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1) if rep > 1 else k.float()
    logits = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    per_head = logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    target = core.max_logits[head_offset : head_offset + per_head.shape[0]]
    torch.maximum(target, per_head.to(target.device), out=target)


class ContextParallelAttention(nn.Module):
    """The attention of one ``CoreAttention`` across the context-parallel ranks.

    Set as the core's ``context_parallel`` submodule by :func:`apply_cp`; the core then hands its
    ``(q, k, v)`` of the local chunks to it (``print(model)`` shows it under every core attention). It
    reads the core's ``scale``, ``dropout`` and max-logit tracking, and holds no parameters or buffers,
    so no name changes.
    """

    def __init__(
        self, method: str, group: Any, cp: int, rank: int, doc_mask: DocumentMask | None = None
    ) -> None:
        super().__init__()
        self.method, self.group, self.cp, self.rank = method, group, cp, rank
        self.doc_mask = doc_mask
        self._attend = _ATTEND[method]

    def extra_repr(self) -> str:
        return (
            f"method={self.method}, cp={self.cp}, rank={self.rank}, document_mask={self.doc_mask is not None}"
        )

    def forward(self, core: nn.Module, q, k, v, allowed=None) -> torch.Tensor:
        if allowed is not None:
            raise DataError(
                "context parallel got an attention mask built from the local chunks; document masks must "
                "reach the model through the batch (attention_mask / actual_seq_len)."
            )
        doc = None if self.doc_mask is None else self.doc_mask.layout
        return self._attend(core, q, k, v, self.group, self.cp, self.rank, doc)


_ATTEND = {"ulysses": _attend_ulysses, "colossal": _attend_gathered_kv, "hybrid": _attend_hybrid}


def apply_cp(
    model: nn.Module, cp_mesh: Any, method: str, split_mesh: Any = None, doc_mask: DocumentMask | None = None
) -> None:
    """Give every ``CoreAttention`` of ``model`` a :class:`ContextParallelAttention` (in place).

    ``split_mesh`` (hybrid only) has the cp ranks as ``(cp_ring, cp_uly)`` dimensions.
    """
    group = cp_mesh.get_group()
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if method == "hybrid":
        group = (split_mesh["cp_uly"].get_group(), split_mesh["cp_ring"].get_group())
    cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
    if not cores:
        raise ConfigError(
            "parallelism.context_parallel > 1 needs attention built on lmforge's CoreAttention (the "
            "'core_attention' of lmforge's model families); this model has none."
        )
    for core in cores:
        # Tensor parallel still binds a forward of its own to the core (its max-logit head offset, which
        # the context-parallel attention reads too); the class's forward must run to reach ours.
        vars(core).pop("forward", None)
        core.context_parallel = ContextParallelAttention(method, group, cp, rank, doc_mask)
