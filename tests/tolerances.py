"""Tolerances that follow from the dtype and the operation, never from one machine's rounding.

The rule (docs/architecture.md, "Testing"):

* The same kernels on the same inputs in the same order are compared exactly (``torch.equal``): resume,
  replay, determinism.
* The same mathematics computed in another order or by other kernels (sharded against whole, fused
  against unfused, chunked against plain, another CPU's SIMD width: AVX2 and AVX-512 kernels round the
  last bits differently) are compared with :func:`reordered`: a relative tolerance of 16 units of
  roundoff of the dtype, and an absolute one of the same 16 units scaled by the largest magnitude of the
  reference. Reordered sums err in proportion to the size of what they add, not of their result, so an
  element that is near zero by cancellation gets the absolute part.
* Comparisons across dtypes (a bf16 run against an fp32 one) or through training steps, whose errors
  compound, state their own bound with the reason next to it.
"""

from __future__ import annotations

import torch

ROUNDOFF_UNITS = 16


def reordered(dtype: torch.dtype, reference: torch.Tensor | None = None) -> dict[str, float]:
    """``rtol``/``atol`` for :func:`torch.testing.assert_close` of the same values computed in another
    order in ``dtype``; ``reference`` gives the magnitude the absolute tolerance scales with."""
    eps = torch.finfo(dtype).eps
    magnitude = 1.0 if reference is None else max(float(reference.detach().abs().max()), 1.0)
    return {"rtol": ROUNDOFF_UNITS * eps, "atol": ROUNDOFF_UNITS * eps * magnitude}
