"""Throughput helpers: the matmul peak of this device (the MFU denominator) and peak memory."""

from __future__ import annotations

import functools
import resource
import sys
import time

import torch


@functools.lru_cache(maxsize=8)
def matmul_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 0.3
) -> float:
    """FLOP/s of a square ``size`` matmul in ``dtype`` on ``device``, measured now.

    MFU is reported against this measured peak rather than a datasheet number: on a CPU there is
    no datasheet number, and on a GPU it tells what this device delivers in this process.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16  # fp16 has no fast CPU path; the model would not use it either
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        n += 1
        if n % 4 == 0:
            _sync(device)
            if time.perf_counter() - t0 >= seconds:
                break
    elapsed = time.perf_counter() - t0
    return 2.0 * size**3 * n / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_memory_gib(device: torch.device) -> float:
    """Peak memory so far: allocated device memory on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux
