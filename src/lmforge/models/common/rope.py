"""Rotary position embedding: plain, linear, Llama-3 and YaRN frequency rules.

The rotation uses the "rotate half" layout (the first half of the rotary dims pairs with the second
half). Checkpoints that store interleaved pairs (DeepSeek-V3's ``rope_interleave``) are permuted into
this layout by their ``hf_adapter``, which gives bit-identical logits and keeps one code path here.
Angles, cos and sin are always computed in fp32 (the original's ``rotary_dtype: float32``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lmforge.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_factor(rope_scaling: dict[str, Any] | None) -> float:
    """Multiplier of the attention softmax scale under YaRN with ``mscale_all_dim`` (DeepSeek-V3)."""
    if not rope_scaling or rope_scaling.get("rope_type") != "yarn":
        return 1.0
    mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
    if not mscale_all_dim:
        return 1.0
    m = _yarn_mscale(float(rope_scaling["factor"]), float(mscale_all_dim))
    return m * m


def rope_frequencies(
    dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` (fp32) and the cos/sin magnitude factor."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not rope_scaling:
        return inv_freq, 1.0
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        orig = float(rope_scaling.get("original_max_position_embeddings") or max_position_embeddings)
        beta_fast = float(rope_scaling.get("beta_fast") or 32)
        beta_slow = float(rope_scaling.get("beta_slow") or 1)
        mscale = rope_scaling.get("mscale")
        mscale_all_dim = rope_scaling.get("mscale_all_dim")
        attention_factor = rope_scaling.get("attention_factor")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(
                    factor, float(mscale_all_dim)
                )
            else:
                attention_factor = _yarn_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope_scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001  # avoid 0/0 in the ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp  # 1 keeps the original frequency, 0 interpolates fully
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq, float(attention_factor)
    raise ConfigError(
        f"model.rope_scaling.rope_type = {kind!r} is not supported; valid: {', '.join(ROPE_TYPES)}."
    )


class RotaryEmbedding(nn.Module):
    """cos and signed sin ``[B, S, dim]`` (fp32) for given positions; frequencies are a non-persistent buffer.

    The second table is ``[-sin, sin]`` over the two halves of the rotary dims (the sign of "rotate half"
    folded in), so :func:`apply_rope` rotates with one concatenation of the swapped halves, without a
    negation (``torch.addcmul`` would save one more kernel but fuses the multiply-add: not bitwise). The tables of the plain positions ``0..S-1``
    (``table``) are computed once per sequence length and device and reused every step.
    """

    def __init__(
        self, dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int
    ) -> None:
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.rope_scaling = rope_scaling
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_factor = rope_frequencies(dim, theta, rope_scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def reset_parameters(self) -> None:
        # Recomputed after ``to_empty`` (meta-device build): buffers come back uninitialised.
        inv_freq, _ = rope_frequencies(self.dim, self.theta, self.rope_scaling, self.max_position_embeddings)
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq.device))
        self._tables.clear()

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def table(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of positions ``[[0, ..., seq_len - 1]]`` (``[1, S, dim]``, broadcast over the batch),
        cached: the tables depend only on the length, and rebuilding them was a dozen kernels per step."""
        key = (int(seq_len), torch.device(device))
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        with torch.no_grad():
            tables = self(torch.arange(seq_len, device=device)[None])
        # Inference-mode tensors may not be saved for a later backward: such calls are not cached.
        if not torch.is_inference_mode_enabled() and not tables[0].is_meta:
            self._tables[key] = tables
        return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, S, D]`` by ``RotaryEmbedding``'s cos / signed sin ``[B, S, D]`` in fp32; returns
    x's dtype. ``x·cos + rotate_half(x)·sin`` of the rotate-half layout, with ``rotate_half(x)·sin`` computed
    as ``[x2, x1]·[-sin, sin]`` (bitwise the same: only the sign moves)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    swapped = torch.cat((x2, x1), dim=-1)  # a cat, not flip(): CPU's flip kernel is 2-3x slower
    return (xf * cos + swapped * sin).to(x.dtype)
