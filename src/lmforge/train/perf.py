"""Throughput helpers: the MFU meter the trainer holds, its denominator (datasheet or measured peak) and
peak memory."""

from __future__ import annotations

import functools
import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.utils.native_dtype import cpu_capability

logger = logging.getLogger(__name__)

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s per device. Matched
# against torch.cuda.get_device_name() in this order (the more specific names first).
DATASHEET_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),  # same compute as H100 SXM
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("MI300X", 1307.0),
    ("MI325X", 1307.0),
)


@dataclass(frozen=True)
class MfuPeak:
    flops: float  # FLOP/s per device
    source: str  # what the number is, for the log: "datasheet bf16 peak of ...", "measured ...", "mfu.peak_tflops"


class MfuMeter:
    """The two factors of a step's MFU: the model's FLOPs per token and the device's peak FLOP/s, each
    worked out once, when first asked (the peak may be measured: a fraction of a second)."""

    def __init__(
        self, model: nn.Module, device: torch.device, mfu_section: Any = None, peak_flops: float | None = None
    ) -> None:
        self.model = model
        self.device = device
        self.mfu_section = mfu_section  # the typed ``mfu:`` section (peak_tflops), or None
        self.peak_flops = peak_flops
        self._flops_per_token: float | None = None

    def flops_per_token(self, seq_length: int) -> float:
        if self._flops_per_token is None:
            fn = getattr(self.model, "flops_per_token", None)
            if callable(fn):
                self._flops_per_token = float(fn(seq_length))
            else:  # dense approximation: 6 FLOPs per parameter per token (forward + backward)
                self._flops_per_token = 6.0 * sum(p.numel() for p in self.model.parameters())
        return self._flops_per_token

    def peak(self) -> float:
        if self.peak_flops is None:
            # The dtype the matmuls run in (the parameters are the fp32 masters).
            dtype = getattr(self.model, "compute_dtype", None) or next(
                (p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32
            )
            override = getattr(self.mfu_section, "peak_tflops", None)
            peak = mfu_peak(self.device, dtype, override)
            logger.info("MFU denominator: %s", peak.source)
            self.peak_flops = peak.flops
        return self.peak_flops


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 datasheet peak of a device name, or None when the table does not know it."""
    name = device_name.upper()
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key in name:
            return tflops
    return None


def mfu_peak(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> MfuPeak:
    """The MFU denominator for a model computing in ``dtype``: ``mfu.peak_tflops`` if set; on CUDA in a
    16-bit dtype the datasheet bf16 peak of the device (as torchtitan and Megatron report MFU); otherwise
    (CPU, float32 compute, an unknown GPU) the measured matmul peak in ``dtype`` itself."""
    if override_tflops:
        return MfuPeak(override_tflops * 1e12, f"mfu.peak_tflops = {override_tflops:g} TFLOP/s")
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        tflops = datasheet_peak_tflops(name)
        if tflops is not None:
            return MfuPeak(tflops * 1e12, f"datasheet dense bf16 peak of {name}, {tflops:g} TFLOP/s")
    measured = matmul_peak_flops(device, dtype)
    name = str(dtype).replace("torch.", "")
    what = f"measured {name} matmul peak of this {device.type} (the model computes in {name})"
    return MfuPeak(measured, f"{what}, {measured / 1e12:.3g} TFLOP/s")


@functools.lru_cache(maxsize=8)
def matmul_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 0.3
) -> float:
    """FLOP/s of a square ``size`` matmul in ``dtype`` on ``device``, measured now: the fastest of the
    groups of four matmuls timed for ``seconds``.

    MFU is reported against this measured peak rather than a datasheet number: on a CPU there is
    no datasheet number, and on a GPU it tells what this device delivers in this process. The fastest
    group rather than the average: a machine busy while the peak is measured would otherwise give a low
    denominator and MFU above 100% once it is idle again.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    if device.type == "cpu" and dtype != torch.float32 and not cpu_capability(dtype):
        # Emulated on this CPU (~100x slower than float32): the peak of what the model really computes,
        # measured on matrices small enough to take a fraction of a second.
        size = min(size, 256)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    _sync(device)
    start = time.perf_counter()
    best = float("inf")
    while True:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        _sync(device)
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 - start >= seconds:
            break
    return 2.0 * size**3 * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_memory_gib(device: torch.device) -> float:
    """Peak memory so far: allocated device memory on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux
