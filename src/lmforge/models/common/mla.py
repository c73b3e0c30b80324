"""Multi-head Latent Attention (DeepSeek-V2/V3) with optional q LoRA and decoupled RoPE.

Weight layout (the up projections per head, as Hugging Face's ``q_b_proj`` / ``kv_b_proj``, so a row
split into whole heads is a valid tensor-parallel shard; ``models/common/fused_layout.py``):

* ``linear_q_proj`` (no q LoRA) or ``linear_q_down_proj`` → ``q_layernorm`` → ``linear_q_up_proj``:
  rows ``[q_nope_h (qk_nope); q_rope_h (qk_rope)]`` for h = 0..heads-1.
* ``linear_kv_down_proj``: rows ``[kv latent (kv_lora_rank); shared k_rope (qk_rope)]``; the shared
  part passes ``shared_k_rope`` (an identity seam for tensor parallel plans).
* ``kv_layernorm`` on the latent, then ``linear_kv_up_proj``: rows ``[k_nope_h; v_h]`` per head.
* ``linear_proj``: ``[hidden, heads*v_head_dim]``.

The forward reads the number of heads from the up projections' output width.

The latent norms use eps 1e-6 as Hugging Face's DeepSeek-V3 does (it ignores ``rms_norm_eps`` there).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.models.common.attention import CoreAttention
from lmforge.models.common.fused_layout import per_head_rows
from lmforge.models.common.norms import RMSNorm
from lmforge.models.common.rope import apply_rope
from lmforge.utils.muon_split import MuonSplit
from lmforge.utils.qk_clip import QKClipLayer, QKClipTarget

LATENT_NORM_EPS = 1e-6


class SharedRopeKey(nn.Module):
    """The rope part of the key ``[b, s, qk_rope]``, shared by all heads, as the heads read it.

    The identity in the model; a seam for parallel plans: under tensor parallel the down projection runs
    replicated while each rank's heads read this part, so the plan turns it into this rank's local tensor
    whose gradient is a partial sum (``parallel/tp.py``). The latent part stays replicated.
    """

    def forward(self, k_rope: torch.Tensor) -> torch.Tensor:
        return k_rope


class MultiLatentAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        q_out = num_heads * (self.dn + self.dr)
        if q_lora_rank:
            self.linear_q_down_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.linear_q_up_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        else:
            self.linear_q_proj = nn.Linear(hidden_size, q_out, bias=False)
        self.linear_kv_down_proj = nn.Linear(hidden_size, kv_lora_rank + self.dr, bias=False)
        self.kv_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.shared_k_rope = SharedRopeKey()
        self.linear_kv_up_proj = nn.Linear(kv_lora_rank, num_heads * (self.dn + self.dv), bias=False)
        self.linear_proj = nn.Linear(num_heads * self.dv, hidden_size, bias=False)
        self.core_attention = CoreAttention(num_heads, softmax_scale, dropout)

    @property
    def _q_weight_name(self) -> str:
        return "linear_q_up_proj" if self.q_lora_rank else "linear_q_proj"

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        if self.q_lora_rank:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        else:
            q = self.linear_q_proj(x)
        q = q.unflatten(-1, (-1, self.dn + self.dr)).transpose(1, 2)  # [b, heads, s, dn + dr]
        n = q.shape[1]
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)

        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)
        k_rope = apply_rope(self.shared_k_rope(k_rope).view(b, s, 1, self.dr).transpose(1, 2), cos, sin)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent))
        k_nope, v = (
            kv.unflatten(-1, (-1, self.dn + self.dv)).transpose(1, 2).split([self.dn, self.dv], dim=-1)
        )

        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, n, -1, -1)], dim=-1)
        out = self.core_attention(q, k, v, allowed)
        return self.linear_proj(out.transpose(1, 2).flatten(2))

    # ---- hooks for the optimizer and checkpoints -------------------------------------------------
    def layout_v1_rows(self) -> dict[str, tuple[int, torch.Tensor]]:
        """Fused child → (dim, rows) with ``stored = layout1[rows]`` (``fused_layout.py``)."""
        n = self.num_heads
        return {
            self._q_weight_name: (0, per_head_rows(n, self.dn, self.dr)),
            "linear_kv_up_proj": (0, per_head_rows(n, self.dn, self.dv)),
        }

    def muon_split_schema(self, prefix: str) -> dict[str, MuonSplit]:
        """nope / rope of q and k_nope / v as separate matrices (all heads each)."""
        n = self.num_heads
        q_order = torch.argsort(per_head_rows(n, self.dn, self.dr))
        kv_order = torch.argsort(per_head_rows(n, self.dn, self.dv))
        return {
            f"{prefix}.{self._q_weight_name}.weight": MuonSplit(0, [n * self.dn, n * self.dr], q_order),
            f"{prefix}.linear_kv_down_proj.weight": MuonSplit(0, [self.kv_lora_rank, self.dr]),
            f"{prefix}.linear_kv_up_proj.weight": MuonSplit(0, [n * self.dn, n * self.dv], kv_order),
        }

    def qk_clip_layer(self, prefix: str) -> QKClipLayer:
        """q_nope and k_nope rows by sqrt(gamma_h), q_rope rows by gamma_h; the shared k_rope and v stay."""
        n = self.num_heads
        heads = torch.arange(n)[:, None]
        q_name = f"{prefix}.{self._q_weight_name}.weight"
        q_heads = torch.arange(n * (self.dn + self.dr)).view(n, self.dn + self.dr)  # the stored layout
        kv_heads = torch.arange(n * (self.dn + self.dv)).view(n, self.dn + self.dv)
        layer = QKClipLayer(name=prefix, max_logits=self.core_attention.max_logits)
        layer.targets.append(QKClipTarget(q_name, 0, q_heads[:, : self.dn], heads, 0.5))
        layer.targets.append(QKClipTarget(q_name, 0, q_heads[:, self.dn :], heads, 1.0))
        layer.targets.append(
            QKClipTarget(f"{prefix}.linear_kv_up_proj.weight", 0, kv_heads[:, : self.dn], heads, 0.5)
        )
        return layer

    def flops_per_token(self, hidden_size: int, seq_length: int) -> float:
        n = self.num_heads
        q_out = n * (self.dn + self.dr)
        q = (
            2 * (hidden_size * self.q_lora_rank + self.q_lora_rank * q_out)
            if self.q_lora_rank
            else 2 * hidden_size * q_out
        )
        kv = 2 * hidden_size * (self.kv_lora_rank + self.dr) + 2 * self.kv_lora_rank * n * (self.dn + self.dv)
        proj = 2 * n * self.dv * hidden_size
        core = 2 * n * (self.dn + self.dr) * seq_length + 2 * n * self.dv * seq_length
        return q + kv + proj + core
