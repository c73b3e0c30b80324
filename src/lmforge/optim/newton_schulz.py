"""Newton-Schulz orthogonalisation for Muon: schedules, and batched iteration over many matrices.

For ``X`` of shape ``[A, B]`` (``A <= B``; a tall matrix is transposed first so the Gram matrix is
the small one): ``X <- X / (||X||_F + eps)``, then per step ``(a, b, c)``:
``P = X X^T``, ``X <- a X + (b P + c P^2) X``. The result approximates ``U V^T`` of ``X = U S V^T``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


# A shape whose matrices have at most this many elements is orthogonalised as one stacked batch
# (bmm): small matrices leave the matmul units idle one at a time. Larger ones run one matrix at a time
# (mm), which measured faster than bmm on them (bench/optim.py, docs/benchmarks.md "Optimizer step").
# The choice depends on the shape only, so a matrix's result never depends on how many others share
# its batch (bmm of a batch equals bmm of each of its slices bitwise, and the sharded strategies rely
# on that to match the single process).
STACK_MAX_ELEMENTS = 1 << 18
# A matrix run on its own computes its symmetric Gram matrix and polynomial in k x k blocks of at least
# SYMMETRIC_BLOCK rows (k <= SYMMETRIC_MAX_PARTS), only those on and below the diagonal. On this CPU
# (1 thread, CPU time) 3 blocks of 256 took 0.82-0.92x the time of the whole products at 768 rows;
# smaller blocks cost more in calls than they save.
SYMMETRIC_BLOCK = 256
SYMMETRIC_MAX_PARTS = 4


def symmetric_parts(matrix_shape: Sequence[int]) -> int:
    """How many row blocks the Gram matrix of one ``[A, B]`` matrix is computed in (1: whole)."""
    return max(1, min(SYMMETRIC_MAX_PARTS, min(matrix_shape[-2:]) // SYMMETRIC_BLOCK))


class Workspace:
    """Buffers for Newton-Schulz kept across optimizer steps, by (name, shape, dtype, device).

    On a CPU every fresh tensor of megabytes is new memory from the OS whose first touch page-faults
    (a 75 MB bf16 clone measured 70 ms against 10 ms for a copy into an existing tensor), so Muon keeps
    its buffers. Elsewhere (CUDA) the caching allocator already reuses memory and keeping buffers
    would only pin it, so ``keep`` is off there.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        key = (name, tuple(shape), dtype, device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf


def _normalize_(X: torch.Tensor, eps: float) -> None:
    # Frobenius norm per matrix. The CPU kernel accumulates a bf16 input in fp32 and rounds only the
    # result, as the former dtype=float32 call followed by a cast did, without its fp32 copy of X.
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X.div_(norm.add_(eps))


def _bounds(size: int, parts: int) -> list[int]:
    return [size * i // parts for i in range(parts + 1)]


def _mirror_(out: torch.Tensor, h: list[int]) -> None:
    """Copy the lower triangle of blocks of a symmetric ``out`` into the upper one, a row strip at a time."""
    for j in range(len(h) - 2):
        out[h[j] : h[j + 1], h[j + 1] :].copy_(out[h[j + 1] :, h[j] : h[j + 1]].mT)


def _gram_(X: torch.Tensor, out: torch.Tensor, parts: int) -> None:
    """``out = X X^T`` (``X`` ``[s, n]``, or a batch). ``parts > 1``: the product is symmetric, so
    compute only the lower triangle of a ``parts x parts`` tiling, one column panel (the diagonal block
    and everything under it) per matmul, and mirror the rest: ``(parts + 1) / (2 parts)`` of the FLOPs,
    the same dot products. A panel per call rather than a block per call: ``parts`` calls instead of
    ``parts (parts + 1) / 2``, each larger, which splits better over threads (docs/benchmarks.md)."""
    if parts == 1:
        torch.matmul(X, X.mT, out=out)
        return
    h = _bounds(X.shape[-2], parts)
    for j in range(parts):
        cols = slice(h[j], h[j + 1])
        torch.mm(X[h[j] :], X[cols].mT, out=out[h[j] :, cols])
    _mirror_(out, h)


def _poly_(P: torch.Tensor, out: torch.Tensor, b: float, c: float, parts: int) -> None:
    """``out = b P + c P^2`` for a symmetric ``P`` (so ``P^2 = P P^T``); ``parts`` as in :func:`_gram_`."""
    if parts == 1:
        (torch.baddbmm if P.dim() == 3 else torch.addmm)(P, P, P, beta=b, alpha=c, out=out)
        return
    h = _bounds(P.shape[-1], parts)
    for j in range(parts):
        cols = slice(h[j], h[j + 1])
        torch.addmm(P[h[j] :, cols], P[h[j] :], P[cols].mT, beta=b, alpha=c, out=out[h[j] :, cols])
    _mirror_(out, h)


def _iterate_(X: torch.Tensor, Y: torch.Tensor, P: torch.Tensor, Q: torch.Tensor, schedule: Schedule) -> None:
    """Newton-Schulz on ``X`` (``[A, B]`` or ``[n, A, B]``) in place; ``Y``, ``P``, ``Q`` are scratch.

    Wide (``A <= B``): ``P = X X^T`` and ``X <- a X + Q X``. Tall: the same map written on the right,
    ``P = X^T X`` and ``X <- a X + X Q`` (``Q = b P + c P^2`` is symmetric), so a tall matrix needs no
    transposed copy and its Gram matrix is still the small side. A single large matrix computes the
    symmetric ``P`` and ``Q`` block-triangle only (:func:`_gram_`), which torch's Muon does not.
    """
    addmm = torch.baddbmm if X.dim() == 3 else torch.addmm
    tall = X.shape[-2] > X.shape[-1]
    parts = symmetric_parts(X.shape) if X.dim() == 2 else 1
    src, dst = X, Y
    for a, b, c in schedule:
        _gram_(src.mT if tall else src, P, parts)
        _poly_(P, Q, b, c, parts)
        if tall:
            addmm(src, src, Q, beta=a, out=dst)  # a X + X Q
        else:
            addmm(src, Q, src, beta=a, out=dst)  # a X + Q X
        src, dst = dst, src
    if src is not X:
        X.copy_(src)


def orthogonalize_(X: torch.Tensor, schedule: Schedule, eps: float, workspace: Workspace) -> None:
    """Newton-Schulz of every matrix of ``X`` (``[n, A, B]``, contiguous) in place."""
    n, rows, cols = X.shape
    s = min(rows, cols)
    _normalize_(X, eps)
    # The one-matrix path and its blocked products were measured on a CPU only; elsewhere (CUDA, where
    # every extra call is a kernel launch) all matrices of a shape stay in one batched matmul.
    if rows * cols <= STACK_MAX_ELEMENTS or X.device.type != "cpu":
        Y = workspace.get("ns_y", (n, rows, cols), X.dtype, X.device)
        P = workspace.get("ns_p", (n, s, s), X.dtype, X.device)
        Q = workspace.get("ns_q", (n, s, s), X.dtype, X.device)
        _iterate_(X, Y, P, Q, schedule)
        return
    Y = workspace.get("ns_y", (rows, cols), X.dtype, X.device)
    P = workspace.get("ns_p", (s, s), X.dtype, X.device)
    Q = workspace.get("ns_q", (s, s), X.dtype, X.device)
    for i in range(n):
        _iterate_(X[i], Y, P, Q, schedule)


def orthogonalize_into(
    shapes: Sequence[torch.Size],
    fill: Callable[[int, torch.Tensor], None],
    schedule: Schedule,
    eps: float,
    dtype: torch.dtype,
    device: torch.device,
    workspace: Workspace,
) -> list[torch.Tensor]:
    """Newton-Schulz of matrices written straight into Muon's buffers; returns each result.

    ``shapes[i]`` is ``[A, B]`` or ``[E, A, B]`` (a stack, orthogonalised per matrix); ``fill(i, slot)``
    writes matrix ``i`` into ``slot`` (``dtype``, ``shapes[i]``), e.g. the Nesterov sum cast on the way.
    Matrices of one shape share one buffer ``[n, A, B]``. The results are views of the workspace's
    buffers: valid until the next call with the same workspace.
    """
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        buckets.setdefault((shape[-2], shape[-1]), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(shapes)
    for (rows, cols), idx in buckets.items():
        counts = [math.prod(shapes[i][:-2]) for i in idx]
        X = workspace.get(f"ns_x{len(idx)}", (sum(counts), rows, cols), dtype, device)
        start = 0
        for i, n in zip(idx, counts):
            slot = X[start : start + n].view(shapes[i])
            fill(i, slot)
            out[i] = slot
            start += n
        orthogonalize_(X, schedule, eps, workspace)
    return out  # type: ignore[return-value]


def orthogonalize_many(
    mats: Sequence[torch.Tensor], schedule: Schedule, eps: float, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    """Newton-Schulz of every matrix in ``mats`` (each ``[A, B]`` or ``[E, A, B]``), in ``dtype``.

    Matrices of the same shape are iterated together; ``mats`` are never modified (torch 2.13's Muon
    normalises an aliased bf16 input in place, which corrupts a bf16 momentum buffer).
    """
    if not mats:
        return []
    return orthogonalize_into(
        [m.shape for m in mats],
        lambda i, slot: slot.copy_(mats[i]),
        schedule,
        eps,
        dtype,
        mats[0].device,
        Workspace(),  # fresh buffers: the results outlive this call
    )


def newton_schulz(
    x: torch.Tensor, schedule: Schedule, eps: float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Orthogonalise each matrix of ``x`` (``[..., A, B]``); returns ``dtype``, same shape; ``x`` untouched."""
    if x.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(x.shape)}")
    return orthogonalize_many([x.reshape(-1, x.shape[-2], x.shape[-1])], schedule, eps, dtype)[0].view(
        x.shape
    )
