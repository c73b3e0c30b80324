"""Attention masks from the data pipeline's two document-mask forms.

* ``attention_mask``: Megatron layout ``[B or 1, 1, S, S]``, bool or int, True/1 = masked out.
* ``actual_seq_len``: the compressed EOD form, ``[B, n]`` or ``[n]``: end offsets (exclusive) of the
  documents packed in a row, padded with S. Token t belongs to document ``#{ends <= t}``.

Both become one boolean "may attend" mask ``[B or 1, 1, S, S]`` (True = attend) that already includes
causality, or ``None`` for the plain causal case (SDPA then uses its ``is_causal`` fast path).
"""

from __future__ import annotations

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
