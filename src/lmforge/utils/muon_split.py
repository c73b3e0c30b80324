"""How Muon splits a fused weight into the logical matrices it orthogonalises one by one.

A model's ``muon_split_schema()`` maps parameter names to ``MuonSplit(dim, sizes, order)``: along
``dim``, the pieces are ``sizes`` consecutive blocks of ``u.index_select(dim, order)`` (``order`` None:
of ``u`` itself). ``order`` lets a weight whose pieces are interleaved in storage (QKV grouped per
key-value group, gate/up row pairs, MLA heads) be split into the same logical matrices (all of Q,
all of K, ...) as a weight that stores them as contiguous blocks. A plain ``(dim, sizes)`` tuple is
accepted too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class MuonSplit(NamedTuple):
    dim: int
    sizes: list[int]
    order: torch.Tensor | None = None  # the stored row of each row of the concatenated pieces


def as_muon_split(value: Any) -> MuonSplit:
    return value if isinstance(value, MuonSplit) else MuonSplit(*value)


def split_pieces(u: torch.Tensor, split: MuonSplit) -> list[torch.Tensor]:
    if split.order is not None:
        u = u.index_select(split.dim, split.order.to(u.device))
    return list(torch.split(u, split.sizes, dim=split.dim))


def join_pieces(pieces: list[torch.Tensor], split: MuonSplit) -> torch.Tensor:
    """The inverse of :func:`split_pieces`: the pieces back in the stored order."""
    joined = torch.cat(pieces, dim=split.dim)
    if split.order is None:
        return joined
    inverse = torch.argsort(split.order.to(joined.device))
    return joined.index_select(split.dim, inverse)
