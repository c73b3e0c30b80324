"""Token cross-entropy: the plain path (full logits) and the chunked linear cross-entropy.

``chunked_linear_cross_entropy`` computes ``CE(hidden @ weightᵀ, labels)`` a chunk of tokens at a time,
so the ``[tokens, vocab]`` logits exist only one chunk at a time, in forward and in backward: the
backward recomputes each chunk's logits from the saved hidden states and weight instead of keeping
them. For Qwen3's 151,936-token vocabulary at seq 4096 that is 2.5 GB of fp32 logits (plus their
gradient) replaced by ``chunk × vocab × 4`` bytes.

The numerics follow the plain path: the logits are computed in the inputs' dtype and promoted to fp32
for the log-softmax; the logits' gradient is cast back to the inputs' dtype before the two matmuls
(what autograd does for ``logits.float()``). The weight gradient is accumulated over chunks in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_weights(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """fp32 per-token weights ``[N]``: 0 for labels < 0 and where ``loss_mask`` is 0."""
    weights = (labels.reshape(-1) >= 0).float()
    if loss_mask is not None:
        weights = weights * loss_mask.reshape(-1).float()
    return weights


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sum of CE over valid tokens, number of valid tokens). Labels < 0 and loss_mask 0 are excluded."""
    weights = loss_weights(labels, loss_mask)
    flat = labels.reshape(-1).long().clamp(min=0)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, reduction="none")
    return (ce * weights).sum(), weights.sum()


def _chunk_ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token CE, fp32 logits) of one chunk."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    return lse - logits.gather(1, labels[:, None]).squeeze(1), logits


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk):  # type: ignore[override]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            ce, _ = _chunk_ce(hidden[sl] @ weight.t(), labels[sl])
            total = total + (ce * weights[sl]).sum()
        ctx.save_for_backward(hidden, weight, labels, weights)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, labels, weights = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        scale = weights * grad_total.float()
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h = hidden[sl]
            logits = (h @ weight.t()).float()
            # d CE / d logits = softmax - onehot(label), times each token's weight.
            grad = torch.softmax(logits, dim=-1)
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, labels[sl]] -= 1.0
            grad = (grad * scale[sl, None]).to(hidden.dtype)
            if need_h:
                grad_h[sl] = grad @ weight
            if need_w:
                grad_w += (grad.t() @ h).float()
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sum of CE over valid tokens, number of valid tokens) of ``hidden @ weightᵀ`` without the full logits.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``labels`` ``[...]`` (< 0 = ignored), ``loss_mask``
    broadcastable to ``labels`` or None. Same values and gradients as ``token_cross_entropy`` on
    ``F.linear(hidden, weight)``.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    weights = loss_weights(labels, loss_mask)
    flat_labels = labels.reshape(-1).long().clamp(min=0)
    total = _ChunkedLinearCE.apply(flat_h, weight, flat_labels, weights, int(chunk_size))
    return total, weights.sum()
