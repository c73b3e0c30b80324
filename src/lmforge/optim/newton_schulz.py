"""Newton-Schulz orthogonalisation for Muon: schedules, and batched iteration over many matrices.

For ``X`` of shape ``[A, B]`` (``A <= B``; a tall matrix is transposed first so the Gram matrix is
the small one): ``X <- X / (||X||_F + eps)``, then per step ``(a, b, c)``:
``P = X X^T``, ``X <- a X + (b P + c P^2) X``. The result approximates ``U V^T`` of ``X = U S V^T``.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real

import torch

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

Schedule = tuple[tuple[float, float, float], ...]


def _is_number(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def normalize_ns_schedule(ns_coefficients: object, ns_steps: int) -> tuple[Schedule, int]:
    """Turn ``ns_coefficients`` into one ``(a, b, c)`` per step; returns ``(schedule, steps)``.

    Flat ``[a, b, c]`` is repeated ``ns_steps`` times. Segmented ``[[[a, b, c], count], ...]`` is the
    concatenation of its segments and ``ns_steps`` is ignored. Error texts are the original's.
    """
    if (
        isinstance(ns_coefficients, str | bytes)
        or not isinstance(ns_coefficients, Sequence)
        or not ns_coefficients
    ):
        raise ValueError(f"ns_coefficients must be a non-empty list/tuple, got {ns_coefficients!r}.")
    if _is_number(ns_coefficients[0]):
        if len(ns_coefficients) != 3:
            raise ValueError(f"flat ns_coefficients must have 3 elements, got {list(ns_coefficients)!r}.")
        if not all(_is_number(v) for v in ns_coefficients):
            raise ValueError(f"flat ns_coefficients must hold 3 numbers, got {list(ns_coefficients)!r}.")
        if ns_steps <= 0:
            raise ValueError(f"ns_steps must be positive, got {ns_steps}.")
        triple = tuple(float(v) for v in ns_coefficients)
        return (triple,) * ns_steps, ns_steps  # type: ignore[return-value]
    schedule: list[tuple[float, float, float]] = []
    for i, seg in enumerate(ns_coefficients):
        if isinstance(seg, str | bytes) or not isinstance(seg, Sequence) or len(seg) != 2:
            raise ValueError(f"segmented ns_coefficients entry {i} must be [[a, b, c], count], got {seg!r}.")
        triple, count = seg
        if (
            isinstance(triple, str | bytes)
            or not isinstance(triple, Sequence)
            or len(triple) != 3
            or not all(_is_number(v) for v in triple)
        ):
            raise ValueError(
                f"segmented ns_coefficients entry {i} must hold a 3-element triple, got {triple!r}."
            )
        if not _is_number(count) or int(count) != count or int(count) <= 0:
            raise ValueError(f"segmented ns_coefficients entry {i} count must be positive, got {count!r}.")
        schedule.extend([tuple(float(v) for v in triple)] * int(count))  # type: ignore[list-item]
    return tuple(schedule), len(schedule)


def newton_schulz(
    x: torch.Tensor, schedule: Schedule, eps: float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Orthogonalise each matrix of ``x`` (``[..., A, B]``); returns ``dtype``, same shape.

    ``x`` is never modified (torch 2.13's Muon normalises an aliased bf16 input in place, which
    corrupts a bf16 momentum buffer; we always work on a new tensor).
    """
    if x.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(x.shape)}")
    shape = x.shape
    tall = shape[-2] > shape[-1]
    # Always batched (a lone matrix is a batch of one), so a matrix's result never depends on which
    # other matrices share its batch: the sharded strategies then match the single process bitwise.
    X = x.reshape(-1, shape[-2], shape[-1]).to(dtype)
    if tall:
        X = X.mT
    # Frobenius norm per matrix, accumulated in fp32 (bf16 would round the sum).
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=acc)
    X = X / (norm + eps).to(dtype)
    for a, b, c in schedule:
        P = torch.bmm(X, X.mT)
        Q = torch.baddbmm(P, P, P, beta=b, alpha=c)  # b*P + c*P@P
        X = torch.baddbmm(X, Q, X, beta=a)  # a*X + Q@X
    if tall:
        X = X.mT
    return X.reshape(shape)


def orthogonalize_many(
    mats: Sequence[torch.Tensor], schedule: Schedule, eps: float, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    """Newton-Schulz of every matrix in ``mats`` (each ``[A, B]`` or ``[E, A, B]``).

    Matrices with the same shape up to transposition are stacked and iterated together with batched
    matmuls, which is where Muon's step beats a per-matrix loop.
    """
    buckets: dict[tuple[int, int, torch.device], list[int]] = {}
    flat: list[torch.Tensor] = []
    for i, m in enumerate(mats):
        m3 = m.reshape(-1, m.shape[-2], m.shape[-1]).to(dtype)
        if m3.shape[-2] > m3.shape[-1]:
            m3 = m3.mT
        flat.append(m3)
        buckets.setdefault((m3.shape[-2], m3.shape[-1], m3.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(mats)
    for idx in buckets.values():
        # Contiguous in every case: a transposed view takes a different (not bitwise equal) bmm path.
        stacked = flat[idx[0]].contiguous() if len(idx) == 1 else torch.cat([flat[i] for i in idx])
        result = newton_schulz(stacked, schedule, eps, dtype)
        start = 0
        for i in idx:
            n = flat[i].shape[0]
            r = result[start : start + n]
            start += n
            m = mats[i]
            if m.shape[-2] > m.shape[-1]:
                r = r.mT
            out[i] = r.reshape(m.shape)
    return out  # type: ignore[return-value]
