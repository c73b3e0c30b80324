"""Attention: the SDPA core (with optional per-head max-logit tracking) and the GQA self-attention block.

Parameter names follow Megatron / MindSpore Transformers: ``linear_qkv`` holds the fused rows grouped per
key-value group, ``[q of the group's heads (H/G*d); k_g (d); v_g (d)]`` for g = 0..G-1 (Megatron's layout,
``models/common/fused_layout.py``), ``linear_proj`` is the output projection, and ``q_layernorm`` /
``k_layernorm`` are the per-head QK norms (Qwen3). The forward reads the number of groups from the
projection's output width, so a tensor-parallel rank holding whole groups runs the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.common.fused_layout import qkv_rows
from lmforge.models.common.masks import DocumentSegments
from lmforge.models.common.norms import RMSNorm
from lmforge.models.common.rope import apply_rope
from lmforge.utils.muon_split import MuonSplit
from lmforge.utils.qk_clip import QKClipLayer, QKClipTarget


@torch.compiler.disable
def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: DocumentSegments,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal SDPA inside each document span, O(S) extra memory: no ``[S, S]`` mask is built.

    Rows that share their spans (a 1-D ``actual_seq_len``) are computed together. Each span is one
    SDPA call with ``is_causal=True``, so the fused (flash) kernels stay usable. Excluded from
    ``torch.compile`` graphs: the spans are Python integers that change every batch.
    """
    gqa = q.shape[1] != k.shape[1]

    def attend(rows: slice, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
        parts = [
            F.scaled_dot_product_attention(
                q[rows, :, a:b],
                k[rows, :, a:b],
                v[rows, :, a:b],
                is_causal=True,
                scale=scale,
                dropout_p=dropout,
                enable_gqa=gqa,
            )
            for a, b in spans
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    if len(segments.spans) == 1:
        return attend(slice(None), segments.spans[0])
    return torch.cat([attend(slice(i, i + 1), segments.row(i)) for i in range(q.shape[0])], dim=0)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA with ``enable_gqa`` when K/V have fewer heads. A branch, not ``enable_gqa=Hq != Hkv``: with
    dynamic shapes (a recompile after a shape change) that comparison is a SymBool, which SDPA refuses,
    breaking the compiled block's graph at every call; a branch makes dynamo guard on it instead."""
    if q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


class CoreAttention(nn.Module):
    """softmax(q·kᵀ·scale + mask)·v on ``scaled_dot_product_attention``; tracks per-head max logits.

    ``max_logits`` (fp32 ``[heads]``, a non-persistent buffer) is the running maximum of the pre-softmax
    logits q·k·scale over the unmasked entries of every call made while ``track_max_logits`` is True.
    It is detached and starts at 0, so a head never gets a clip factor above 1 from a reset value.
    """

    def __init__(self, num_heads: int, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = scale
        self.dropout = dropout
        self.track_max_logits = False
        # The global index of the first head this module computes: 0, or this rank's first head when
        # tensor parallel hands it a slice of the heads (max_logits stays indexed by global head).
        self.head_offset = 0
        self.register_buffer("max_logits", torch.zeros(num_heads, dtype=torch.float32), persistent=False)
        # parallel/cp.py sets a ContextParallelAttention here: attention across context-parallel ranks.
        self.register_module("context_parallel", None)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.max_logits.zero_()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor | DocumentSegments | None,
    ) -> torch.Tensor:
        """q ``[B, Hq, S, Dk]``, k ``[B, Hkv, S, Dk]``, v ``[B, Hkv, S, Dv]`` → ``[B, Hq, S, Dv]``."""
        if self.context_parallel is not None:
            return self.context_parallel(self, q, k, v, allowed)
        dropout = self.dropout if self.training else 0.0
        if isinstance(allowed, DocumentSegments):
            if self.track_max_logits:
                self._update_max_logits(q, k, allowed.dense(q.device))
            return segment_attention(q, k, v, allowed, self.scale, dropout)
        if self.track_max_logits:
            self._update_max_logits(q, k, allowed)
        if allowed is None:
            return _sdpa(q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout)
        return _sdpa(q, k, v, attn_mask=allowed, scale=self.scale, dropout_p=dropout)

    @torch.no_grad()
    def _update_max_logits(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> None:
        # The logits are materialised only while tracking is on (Muon QK-Clip or a max-logit monitor).
        rep = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(rep, dim=1) if rep > 1 else k.float()
        logits = torch.matmul(q.float(), kf.transpose(-1, -2)) * self.scale
        seq = q.shape[2]
        if allowed is None:
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()[None, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
        per_head = logits.amax(dim=(0, 2, 3))
        target = self.max_logits[self.head_offset : self.head_offset + per_head.shape[0]]
        torch.maximum(target, per_head.to(target.device), out=target)


class SelfAttention(nn.Module):
    """Multi-head / grouped-query attention with RoPE and optional per-head QK RMSNorm (Qwen3)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        bias: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        # The global counts describe the stored weights (optimizer, QK-Clip and FLOPs hooks); the
        # forward uses only the ratio heads-per-group and the head size.
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.heads_per_group = num_heads // num_kv_heads
        self.q_rows, self.kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        self.linear_qkv = nn.Linear(hidden_size, self.q_rows + 2 * self.kv_rows, bias=bias)
        self.linear_proj = nn.Linear(self.q_rows, hidden_size, bias=bias)
        self.q_layernorm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_layernorm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.core_attention = CoreAttention(num_heads, head_dim**-0.5, dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        r, d = self.heads_per_group, self.head_dim
        qkv = self.linear_qkv(x).unflatten(-1, (-1, r + 2, d))  # [b, s, groups, r + 2, d]
        # split, not slices: its backward is one concatenation, not a zero-filled gradient per piece.
        q, k, v = qkv.split([r, 1, 1], dim=-2)
        q = q.flatten(2, 3)  # head g*r + j is the j-th query head of group g
        k, v = k.squeeze(-2), v.squeeze(-2).transpose(1, 2)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        out = self.core_attention(q, k, v, allowed)
        return self.linear_proj(out.transpose(1, 2).flatten(2))

    # ---- hooks for the optimizer and checkpoints -------------------------------------------------
    def layout_v1_rows(self) -> dict[str, tuple[int, torch.Tensor]]:
        """Fused child → (dim, rows) with ``stored = layout1[rows]`` (``fused_layout.py``)."""
        return {"linear_qkv": (0, qkv_rows(self.num_heads, self.num_kv_heads, self.head_dim))}

    def muon_split_schema(self, prefix: str) -> dict[str, MuonSplit]:
        """Q, K and V as three matrices (all heads / all groups each), as Megatron's Muon does."""
        order = torch.argsort(qkv_rows(self.num_heads, self.num_kv_heads, self.head_dim))
        return {f"{prefix}.linear_qkv.weight": MuonSplit(0, [self.q_rows, self.kv_rows, self.kv_rows], order)}

    def qk_clip_layer(self, prefix: str) -> QKClipLayer:
        """Per head for Q, per KV group for K (the minimum clip factor of the heads sharing it)."""
        n, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        per_group = n // g
        layer = QKClipLayer(name=prefix, max_logits=self.core_attention.max_logits)
        if self.q_layernorm is not None:
            # With QK-norm the projection rows do not reach the logits; the norm gains (shared by all
            # heads) do, so the whole layer is scaled by its smallest factor.
            all_heads = torch.arange(n)[None]
            for name in ("q_layernorm", "k_layernorm"):
                layer.targets.append(
                    QKClipTarget(f"{prefix}.{name}.weight", 0, torch.arange(d)[None], all_heads, 0.5)
                )
            return layer
        group_rows = torch.arange(n * d + 2 * g * d).view(g, per_group + 2, d)  # the stored layout
        q_rows = group_rows[:, :per_group].reshape(n, d)
        k_rows = group_rows[:, per_group]
        k_heads = torch.arange(n).view(g, per_group)
        # A q/k bias is part of the same rows: it scales with them so the logit scales exactly.
        kinds = ("weight", "bias") if self.linear_qkv.bias is not None else ("weight",)
        for kind in kinds:
            name = f"{prefix}.linear_qkv.{kind}"
            layer.targets.append(QKClipTarget(name, 0, q_rows, torch.arange(n)[:, None], 0.5))
            layer.targets.append(QKClipTarget(name, 0, k_rows, k_heads, 0.5))
        return layer

    def flops_per_token(self, hidden_size: int, seq_length: int) -> float:
        """Forward matmul FLOPs per token (scores and values over the full sequence)."""
        proj = 2 * hidden_size * (self.q_rows + 2 * self.kv_rows) + 2 * self.q_rows * hidden_size
        return proj + 2 * 2 * self.num_heads * self.head_dim * seq_length
