"""Attention masks from the data pipeline's two document-mask forms.

* ``attention_mask``: Megatron layout ``[B or 1, 1, S, S]``, bool or int, True/1 = masked out.
* ``actual_seq_len``: the compressed EOD form, ``[B, n]`` or ``[n]``: end offsets (exclusive) of the
  documents packed in a row, padded with S. Token t belongs to document ``#{ends <= t}``.

Both become one boolean "may attend" mask ``[B or 1, 1, S, S]`` (True = attend) that already includes
causality, or ``None`` for the plain causal case (SDPA then uses its ``is_causal`` fast path).

``attention_layout`` is what the model uses: for ``actual_seq_len`` alone it returns
``DocumentSegments`` (the documents' ``[start, end)`` spans, O(S) memory) instead of the dense mask;
attention then runs causally inside each document (``attention.segment_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def causal_allowed(seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def document_ids(actual_seq_len: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document index of every position, ``[B, S]``, from end offsets ``[B, n]`` (or ``[n]``)."""
    ends = actual_seq_len.long()
    if ends.dim() == 1:
        ends = ends.unsqueeze(0)
    positions = torch.arange(seq_len, device=ends.device)
    # searchsorted(right=True) counts the ends <= t, i.e. how many documents finished before t.
    return torch.searchsorted(ends.contiguous(), positions.expand(ends.shape[0], -1).contiguous(), right=True)


def build_allowed_mask(
    seq_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    actual_seq_len: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The boolean may-attend mask ``[B or 1, 1, S, S]``, or None for plain causal attention."""
    if attention_mask is None and actual_seq_len is None:
        return None
    allowed = causal_allowed(seq_len, device)[None, None]
    if attention_mask is not None:
        m = attention_mask.to(device)
        if m.dim() == 2:
            m = m[None, None]
        elif m.dim() == 3:
            m = m[:, None]
        allowed = allowed & ~m.bool()
    if actual_seq_len is not None:
        doc = document_ids(actual_seq_len.to(device), seq_len)  # [B, S]
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    return allowed


@dataclass(frozen=True)
class DocumentSegments:
    """The documents of each row as ``[start, end)`` spans covering ``[0, seq_len)``.

    ``spans`` has one entry per batch row, or a single entry shared by every row (a 1-D
    ``actual_seq_len``). Attention is causal within a span and zero across spans.
    """

    spans: tuple[tuple[tuple[int, int], ...], ...]
    seq_len: int

    def row(self, b: int) -> tuple[tuple[int, int], ...]:
        return self.spans[0] if len(self.spans) == 1 else self.spans[b]

    def ids(self, device: torch.device) -> torch.Tensor:
        """Document index of every position, ``[B or 1, S]`` (O(S); for masks of a few rows)."""
        doc = torch.zeros(len(self.spans), self.seq_len, dtype=torch.long)
        for b, row in enumerate(self.spans):
            for i, (start, end) in enumerate(row):
                doc[b, start:end] = i
        return doc.to(device)

    def dense(self, device: torch.device) -> torch.Tensor:
        """The equivalent boolean may-attend mask ``[B or 1, 1, S, S]`` (for max-logit tracking, tests)."""
        doc = self.ids(device)
        same = doc[:, None, :, None] == doc[:, None, None, :]
        return same & causal_allowed(self.seq_len, device)[None, None]


def document_spans(actual_seq_len: torch.Tensor, seq_len: int) -> DocumentSegments:
    """Spans from end offsets ``[B, n]`` or ``[n]`` (one host copy of the small offsets tensor).

    Token t belongs to document ``#{ends <= t}``, so only the ends strictly inside ``(0, S)`` start
    a new document; repeated ends (empty documents) and the padding value S add nothing.
    """
    ends = actual_seq_len.long()
    rows = ends.tolist() if ends.dim() == 2 else [ends.tolist()]
    spans = []
    for row in rows:
        cuts = [0, *sorted({int(e) for e in row if 0 < int(e) < seq_len}), seq_len]
        spans.append(tuple(zip(cuts[:-1], cuts[1:], strict=True)))
    return DocumentSegments(tuple(spans), seq_len)


def attention_layout(
    seq_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    actual_seq_len: torch.Tensor | None = None,
) -> torch.Tensor | DocumentSegments | None:
    """None (plain causal), ``DocumentSegments`` (``actual_seq_len`` alone) or the dense mask (``attention_mask``)."""
    if attention_mask is None and actual_seq_len is not None:
        segments = document_spans(actual_seq_len, seq_len)
        if all(len(row) == 1 for row in segments.spans):
            return None  # one document per row: plain causal attention
        return segments
    return build_allowed_mask(seq_len, device, attention_mask, actual_seq_len)
