"""Token cross-entropy: the plain path (full logits) and the chunked linear cross-entropy.

``chunked_linear_cross_entropy`` computes ``CE(hidden @ weightᵀ, labels)`` a chunk of tokens at a time,
so the ``[tokens, vocab]`` logits exist only one chunk at a time, in forward and in backward: the
forward computes each chunk's logits once and derives both the loss and the gradients of the hidden
states and the weight from them (no recompute; the backward only scales the stored gradients). For
Qwen3's 151,936-token vocabulary at seq 4096 that is 2.5 GB of fp32 logits (plus their gradient)
replaced by about ``chunk × vocab × 8`` bytes of working memory; what is kept from forward to backward
is the gradients themselves (the size of the hidden states and of the weight).

The numerics follow the plain path: the logits are computed in the inputs' dtype and promoted to fp32
for the log-softmax; the logits' gradient is cast back to the inputs' dtype before the two matmuls
(what autograd does for ``logits.float()``).

The gradient the loss sum will receive in backward (the step's ``1 / tokens``, times the fp16 loss scale)
can be announced in forward (``grad_scale``; the train step does, through :func:`loss_gradient_scale`).
It is then folded into each token's weight before the logits' gradient is rounded to 16 bits, as autograd
does on the plain path, and the backward has nothing left to scale (it multiplies by the ratio of the
gradient that arrived to the one announced: exactly 1). Folding also decides where a 16-bit weight's
gradient is summed over the chunks:

* one or two chunks: in the weight's dtype, the second through ``addmm`` (its product is added in fp32
  inside the matmul and rounded once). Against an fp64 reference this is as precise as summing the two
  rounded products in fp32 (``tests/models/test_chunked_loss_scale.py``), and it needs no fp32 buffer and no
  passes over one;
* more chunks: in fp32 (one 16-bit rounding per chunk's matmul, not one per accumulation: bf16 sums over
  many chunks lose the small ones), rounded to the weight's dtype at the end of forward, which frees the
  fp32 buffer before backward.

Without an announced scale the gradients are computed for a loss gradient of 1, kept (the weight's in fp32
for a 16-bit weight) until backward and scaled there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# The gradient the caller will backpropagate into the next main loss computed in this context (see
# ``loss_gradient_scale``); None: not announced.
_ANNOUNCED_GRAD_SCALE: ContextVar[float | None] = ContextVar("lmforge_loss_gradient_scale", default=None)


@contextmanager
def loss_gradient_scale(scale: float) -> Iterator[None]:
    """Announce, for the models' main losses computed in this block, the gradient their loss sum will get
    in backward (the step's objective is ``loss_sum × scale``): the chunked loss folds it into its
    gradients in forward (see the module docstring). A different gradient still gives exact results."""
    token = _ANNOUNCED_GRAD_SCALE.set(float(scale))
    try:
        yield
    finally:
        _ANNOUNCED_GRAD_SCALE.reset(token)


def announced_gradient_scale() -> float | None:
    """The scale announced by the enclosing :func:`loss_gradient_scale`, or None."""
    return _ANNOUNCED_GRAD_SCALE.get()


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


def chunk_loss_and_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    grad_weights: torch.Tensor,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (fp32 CE sum weighted by ``weights``, d loss / d logits in ``grad_dtype`` weighted by
    ``grad_weights``: the token weights times an announced gradient scale) from its logits, written
    out of place so that ``torch.compile`` fuses it into a few passes over ``[chunk, vocab]``
    (``compile: {enable: true}`` compiles it through :meth:`TokenLoss.compile`). Eager, the in-place code of
    :class:`_ChunkedLinearCE` is the faster one; both compute softmax - onehot times the token weights."""
    lf = logits.float()
    row_max = lf.amax(dim=-1, keepdim=True)
    exp = (lf - row_max).exp()
    sum_exp = exp.sum(dim=-1, keepdim=True)
    target = lf.gather(1, labels[:, None])
    loss = ((row_max + sum_exp.log() - target).squeeze(1) * weights).sum()
    onehot = torch.zeros_like(lf).scatter_(1, labels[:, None], 1.0)
    grad = (exp / sum_exp - onehot) * grad_weights[:, None]
    return loss, grad.to(grad_dtype)


def _add_chunk_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    grad_h_rows: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    first: bool,
) -> None:
    """From one chunk's logits' gradient: write its hidden states' gradient rows, add its weight gradient
    (the first chunk writes it: the buffer starts uninitialised, which saves a zero-fill and its read)."""
    if grad_h_rows is not None:
        torch.mm(grad, weight, out=grad_h_rows)
    if grad_w is not None:
        if grad_w.dtype == weight.dtype:
            if first:
                torch.mm(grad.t(), h, out=grad_w)
            else:
                grad_w.addmm_(grad.t(), h)
        elif first:
            grad_w.copy_(grad.t() @ h)
        else:
            grad_w.add_(grad.t() @ h)


class _ChunkedLinearCE(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, both gradients (the chunk's logits are needed
    for both and are freed right after); backward only scales them by the incoming gradient (over the
    announced one, if any).

    Per chunk the working memory is the ``[chunk, vocab]`` logits in the inputs' dtype, once in fp32
    (turned into the softmax in place) and once as the gradient in the inputs' dtype. The weight
    gradient accumulates in one buffer (``addmm``, as Liger-Kernel does; in fp32 for a 16-bit weight
    unless the module docstring's rule keeps it in the weight's dtype).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk, group, vocab_offset, chunk_fn, grad_scale):  # type: ignore[override]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        folded = grad_scale is not None
        # The gradient's token weights: the announced gradient of the loss sum folded in (before the
        # logits' gradient is rounded to the inputs' dtype, as on the plain path).
        grad_weights = weights * grad_scale if folded else weights
        n_chunks = -(-hidden.shape[0] // chunk)
        sixteen_bit = weight.dtype in (torch.bfloat16, torch.float16)
        acc_dtype = torch.float32 if sixteen_bit and not (folded and n_chunks <= 2) else weight.dtype
        # Uninitialised: the first chunk writes it (zeros when there are no tokens).
        alloc = torch.empty_like if hidden.shape[0] > 0 else torch.zeros_like
        grad_w = alloc(weight, dtype=acc_dtype) if need_w else None
        # Vocabulary-parallel (``group`` set): this rank holds rows [vocab_offset, vocab_offset + V_local)
        # of the weight; a label outside them contributes its target logit on another rank.
        local = labels - vocab_offset
        in_shard = (local >= 0) & (local < weight.shape[0])
        local = local.clamp(0, weight.shape[0] - 1)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            h, lab, mine, wt, gwt = hidden[sl], local[sl], in_shard[sl], weights[sl], grad_weights[sl]
            if chunk_fn is not None and group is None and (need_h or need_w):
                # A compiled chunk_loss_and_grad (compile: {enable: true}); one vocabulary shard only,
                # since the vocabulary-parallel statistics are all-reduced between its steps.
                part, grad = chunk_fn(h @ weight.t(), lab, wt, gwt, hidden.dtype)
                total = total + part
                _add_chunk_grads(grad, h, weight, grad_h[sl] if need_h else None, grad_w, start == 0)
                continue
            logits = (h @ weight.t()).float()
            target = logits.gather(1, lab[:, None]).squeeze(1) * mine
            # log-sum-exp by hand, in place: torch.logsumexp would allocate a second [chunk, vocab] buffer.
            row_max = logits.amax(dim=-1)
            if group is not None:
                dist.all_reduce(row_max, dist.ReduceOp.MAX, group=group)
            probs = logits.sub_(row_max[:, None]).exp_()
            sum_exp = probs.sum(dim=-1)
            if group is not None:
                dist.all_reduce(sum_exp, group=group)
                dist.all_reduce(target, group=group)
            total = total + ((row_max + sum_exp.log() - target) * wt).sum()
            if not (need_h or need_w):
                continue
            # d CE / d logits = (softmax - onehot(label)) × each token's (gradient) weight, as
            # exp × (weight / sum) - weight at the label: one pass over [chunk, vocab] instead of two.
            grad = probs.mul_((gwt / sum_exp)[:, None])
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows[mine], lab[mine]] -= gwt[mine]
            grad = grad.to(hidden.dtype)
            del logits, probs
            _add_chunk_grads(grad, h, weight, grad_h[sl] if need_h else None, grad_w, start == 0)
        if group is not None and need_h:
            dist.all_reduce(grad_h, group=group)  # each rank's vocabulary shard adds its part
        if folded and grad_w is not None and grad_w.dtype != weight.dtype:
            # Already scaled: rounded once, now, and the fp32 buffer is freed before backward.
            grad_w = grad_w.to(weight.dtype)
        # Kept on ctx rather than saved: backward scales them in place (no second weight-sized buffer).
        ctx.grads = (grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.grad_scale = grad_scale
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "chunked_linear_cross_entropy: a second backward through the same loss (retain_graph) is not "
                "supported; set model.loss_chunk_size: 0 for that."
            )
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        scale = grad_total.to(torch.float32)
        if ctx.grad_scale is not None:
            # The gradients already carry the announced scale; a true division (tensor by tensor) gives
            # exactly 1 when the caller backpropagates what it announced, so the products below are exact.
            scale = scale / torch.tensor(ctx.grad_scale, dtype=torch.float32, device=scale.device)
        if grad_h is not None:
            grad_h.mul_(scale)
        if grad_w is not None:
            grad_w.mul_(scale)
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _usable_scale(grad_scale: float | None) -> float | None:
    """An announced scale that can be divided out again in backward (finite, non-zero), else None."""
    if grad_scale is None or not math.isfinite(grad_scale) or grad_scale == 0.0:
        return None
    return float(grad_scale)


def vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup | None]:
    """(rows, first vocabulary id, group) for :func:`chunked_linear_cross_entropy`: a DTensor output weight
    split by vocabulary rows over one mesh dimension gives its local rows; any other is gathered whole."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return weight, 0, None
    mesh = weight.device_mesh
    if mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),):
        rows = -(-weight.shape[0] // mesh.size())  # DTensor's Shard follows torch.chunk
        return weight.to_local(), mesh.get_local_rank() * rows, mesh.get_group()
    return weight.full_tensor(), 0, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    chunk_size: int,
    group: dist.ProcessGroup | None = None,
    vocab_offset: int = 0,
    chunk_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    grad_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sum of CE over valid tokens, number of valid tokens) of ``hidden @ weightᵀ`` without the full logits.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``labels`` ``[...]`` (< 0 = ignored), ``loss_mask``
    broadcastable to ``labels`` or None. Same values and gradients as ``token_cross_entropy`` on
    ``F.linear(hidden, weight)``.

    Vocabulary-parallel: with ``group``, ``weight`` is this rank's rows ``[vocab_offset, vocab_offset +
    V_local)`` of the full weight and ``hidden`` is the same on every rank of ``group``; the softmax
    statistics are all-reduced per chunk (the logits are never gathered), every rank gets the full loss,
    the full ``hidden`` gradient and the gradient of its own weight rows.

    ``chunk_fn``: a (compiled) :func:`chunk_loss_and_grad` that computes each chunk's loss and logits'
    gradient instead of the in-place eager code (not under vocabulary parallel).

    ``grad_scale``: the gradient the returned loss sum will receive in backward, if known (see the module
    docstring); any other gradient still gives exact results.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    if not torch.is_grad_enabled():
        # Evaluation: the forward would still compute both gradients (``needs_input_grad`` follows
        # ``requires_grad``, not the grad mode): two more matmuls per chunk and a weight-sized buffer.
        flat_h, weight = flat_h.detach(), weight.detach()
    weights = loss_weights(labels, loss_mask)
    flat_labels = labels.reshape(-1).long().clamp(min=0)
    total = _ChunkedLinearCE.apply(
        flat_h,
        weight,
        flat_labels,
        weights,
        int(chunk_size),
        group,
        int(vocab_offset),
        chunk_fn,
        _usable_scale(grad_scale),
    )
    return total, weights.sum()


class TokenLoss(nn.Module):
    """The model's output projection and token cross-entropy (``model.token_loss``): chunked when
    ``chunk_size`` > 0 (the logits never exist whole), else plain (``F.linear`` + cross-entropy, the logits
    returned). It holds no parameters: the output weight (the embedding's when tied) comes with each call,
    as stored (a DTensor split by vocabulary rows keeps to its rows in the chunked path).

    A module of its own so that regional compilation (``parallel/compile.py``) compiles it the way it
    compiles the blocks, with ``compile()``, and the tree shows it."""

    def __init__(self, chunk_size: int) -> None:
        super().__init__()
        self.chunk_size = int(chunk_size)
        self._compiled_chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        grad_scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(fp32 CE sum over valid tokens, valid tokens, logits or None). ``grad_scale``: the gradient the
        CE sum will receive in backward, if known (used by the chunked path, see the module docstring)."""
        from torch.distributed.tensor import DTensor

        if self.chunk_size > 0:
            rows, offset, group = vocab_shard(weight)
            loss_sum, count = chunked_linear_cross_entropy(
                hidden,
                rows,
                labels,
                loss_mask,
                self.chunk_size,
                group,
                offset,
                self._compiled_chunk,
                grad_scale,
            )
            return loss_sum, count, None
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight
        logits = F.linear(hidden, full)
        loss_sum, count = token_cross_entropy(logits, labels, loss_mask)
        return loss_sum, count, logits

    def grad_scale_kwargs(self, grad_scale: float | None) -> dict[str, float]:
        """Keyword arguments of this module's call for an announced gradient scale: only the chunked loss
        takes one (a compiled plain loss would be specialised on, and recompiled for, every value)."""
        return {} if grad_scale is None or self.chunk_size <= 0 else {"grad_scale": grad_scale}

    def compile(self, *args, **kwargs) -> None:  # type: ignore[override]
        """Plain: the whole module, as ``nn.Module.compile``. Chunked: each chunk's softmax and logits'
        gradient (:func:`chunk_loss_and_grad`, fused into a few passes over ``[chunk, vocab]``); the chunk
        loop and its matmuls stay eager (they are already memory-bound by design)."""
        if self.chunk_size > 0:
            self._compiled_chunk = torch.compile(chunk_loss_and_grad, *args, **kwargs)
        else:
            super().compile(*args, **kwargs)

    def extra_repr(self) -> str:
        compiled = ", compiled chunks" if self._compiled_chunk is not None else ""
        return f"chunk_size={self.chunk_size}{compiled}"
