"""Under ``torch.no_grad`` (evaluation) the chunked loss computes the loss only: one matmul per chunk."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.models.common.loss import chunked_linear_cross_entropy


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_no_grad_computes_no_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (40,), generator=g)
    with torch.enable_grad(), CountMatmuls() as with_grad:
        train_sum, _ = chunked_linear_cross_entropy(hidden, weight, labels, None, 8)
    with torch.no_grad(), CountMatmuls() as evaluation:
        eval_sum, _ = chunked_linear_cross_entropy(hidden, weight, labels, None, 8)
    assert with_grad.count == 3 * 5  # logits, hidden gradient, weight gradient per chunk
    assert evaluation.count == 5
    assert torch.equal(eval_sum, train_sum.detach())
