"""The interface between attention modules and QK-Clip (the model side and the optimizer side).

A model that supports QK-Clip lists, for every attention layer, where the per-head maximum
attention logit of the current step lives and which rows of which parameters scale with it. The
optimizer (which owns the fp32 masters) applies the scaling after its update; neither side imports
the other.

For head ``h`` with running maximum logit ``m_h`` and threshold ``tau``:
``gamma_h = min(1, tau / m_h)``. A target scales rows ``rows[g]`` of its parameter by
``min(gamma_h for h in heads[g]) ** exponent``: ``exponent`` 0.5 for the query and key parts that
share a dot product (q_nope/k_nope, MHA/GQA q and k), 1.0 for a part whose partner is never scaled
(MLA's q_rope, since the shared rope key is not touched).

A layer with QK-norm (``qk_norm=True``) normalises q and k after the projections, so scaling their
weights cannot lower its logits: the optimizer skips such layers and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class QKClipTarget:
    param_name: str  # fully qualified name, as in model.named_parameters()
    dim: int  # the dimension that ``rows`` index (0 for an nn.Linear weight [out, in])
    rows: torch.Tensor  # LongTensor [G, r]: the r rows of group g
    heads: torch.Tensor  # LongTensor [G, k]: the heads whose logits govern group g (min of their gammas)
    exponent: float  # 0.5 or 1.0, see the module docstring


@dataclass
class QKClipLayer:
    name: str  # module path of the attention layer, e.g. "decoder.layers.3.self_attention"
    max_logits: torch.Tensor  # fp32 [num_heads], running max over the step's micro-batches (detached)
    targets: list[QKClipTarget] = field(default_factory=list)
    qk_norm: bool = False  # True when q/k pass through a norm: clipping their weights has no effect
