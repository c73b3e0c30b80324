"""Optimizer-state compression: moments stored in bf16, updated in fp32 (the article's §3.5/§5.3).

AdamW's ``exp_avg`` / ``exp_avg_sq`` and Muon's momentum buffer may be kept in bfloat16, halving
their memory (8 → 4 bytes per parameter for Adam). The arithmetic stays fp32: a step widens the
stored moments, runs the usual fp32 update, and narrows the result back with **stochastic
rounding**. Round-to-nearest would be biased: with beta2 = 0.999 each step moves ``exp_avg_sq`` by
0.1 %, less than half a bf16 ulp (0.4 %), so the second moment would freeze. Stochastic rounding is
unbiased (E[round(x)] = x). Its random bits come from a generator seeded by (step, tensor index), so
a run is reproducible and a resumed run draws the same bits as one that never stopped. Masters stay
fp32.
"""

from __future__ import annotations

import torch

MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SEED = 0x5EED_B16  # any fixed value: the stream is (seed, step, tensor index)


def stochastic_round_to_bf16_(dst: torch.Tensor, src: torch.Tensor, seed: int) -> None:
    """``dst`` (bf16) <- ``src`` (fp32) rounded stochastically: add uniform noise below bf16's last
    mantissa bit to fp32's bit pattern, then truncate (exact in bf16)."""
    gen = torch.Generator(device=src.device)
    gen.manual_seed(seed)
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=gen)
    bits = src.contiguous().view(torch.int32)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    # Non-finite values keep their bits (inf + noise would become NaN).
    rounded = torch.where(torch.isfinite(src), rounded, src)
    dst.copy_(rounded)


def widen(moments: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 working copies of bf16 moments (fp32 moments are used in place)."""
    return [m if m.dtype == torch.float32 else m.float() for m in moments]


def narrow_(stored: list[torch.Tensor], work: list[torch.Tensor], step: int, streams: list[int]) -> None:
    """Write fp32 working moments back into their bf16 storage (no-op for fp32 storage); each
    tensor rounds with its own random stream (``streams``: a stable id per moment tensor)."""
    for dst, src, stream in zip(stored, work, streams):
        if dst is not src:
            stochastic_round_to_bf16_(dst, src, seed_for(step, stream))


def seed_for(step: int, index: int) -> int:
    return (_SEED + step * 1_000_003 + index * 7919) % (2**63 - 1)
