"""Which 16-bit dtypes this device computes natively, and what ``model.compute_dtype: auto`` picks.

A CPU without native bf16 (AVX2 only, no AVX512_BF16/AMX) emulates bf16 and fp16 matmuls: ~100x slower
than float32 (``../shared/reference/torch_cpu.md``). So the compute dtype follows the device: ``auto`` is
bf16 where the device has it natively (CUDA with bf16 support; a CPU whose oneDNN reports bf16 support
*and* where a short measurement confirms that a bf16 matmul is not slower than a float32 one) and float32
elsewhere. An explicit 16-bit dtype on a device that emulates it trains as asked; :func:`emulation_warning`
is what ``check``, the train preflight and ``doctor`` say about it.

The measurement runs once per process and dtype, on one thread (tens of milliseconds).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch

AUTO = "auto"
KEY = "model.compute_dtype"

# A 16-bit dtype counts as native when its matmul reaches at least this fraction of float32's speed.
# Native bf16 on a CPU is ~2x float32 and emulated ~0.01-0.03x: any threshold between separates them, and
# this one leaves room for a busy machine's noise.
_NATIVE_FRACTION = 0.25
_SIZE = 256


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype a run uses and why (the sentence ``check`` and the log print)."""

    dtype: torch.dtype
    requested: str  # "auto" or the dtype's name as configured
    reason: str

    @property
    def is_auto(self) -> bool:
        return self.requested == AUTO

    def describe(self) -> str:
        how = "auto: " if self.is_auto else ""
        return f"{KEY} = {_name(self.dtype)} ({how}{self.reason})"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_capability(dtype: torch.dtype) -> bool:
    """Whether oneDNN reports native support of ``dtype`` matmuls on this CPU."""
    probe = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }.get(dtype)
    if probe is None:
        return dtype == torch.float32
    fn = getattr(torch.ops.mkldnn, probe, None)
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:
        return False


@contextlib.contextmanager
def _one_thread():
    # One thread: a matmul on a busy machine then waits for no other thread of its team, so the
    # fastest of a few timings is close to the idle machine's.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=4)
def cpu_speed_ratio(dtype: torch.dtype) -> tuple[float, float]:
    """(GFLOP/s of a square matmul in ``dtype`` on one thread of this CPU, its speed as a fraction of
    float32's), measured once per process. The two dtypes alternate in one loop so that both see the same
    load, and the fastest timing of each counts. Where oneDNN reports no native support the matrices are
    smaller (128 instead of 256), so that measuring an emulated dtype costs tens of milliseconds."""
    native = cpu_capability(dtype)
    size = _SIZE if native else _SIZE // 2
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    a16, b16 = a.to(dtype), b.to(dtype)
    rounds, budget_s = (5, 0.03) if native else (2, 0.0)
    best32 = best16 = float("inf")
    with _one_thread():
        torch.mm(a, b), torch.mm(a16, b16)  # warm-up (kernel selection, packing)
        start = time.perf_counter()
        done = 0
        while done < rounds or time.perf_counter() - start < budget_s:
            t0 = time.perf_counter()
            torch.mm(a, b)
            t1 = time.perf_counter()
            torch.mm(a16, b16)
            t2 = time.perf_counter()
            best32, best16 = min(best32, t1 - t0), min(best16, t2 - t1)
            done += 1
    return 2.0 * size**3 / best16 / 1e9, best32 / best16


def cuda_native(dtype: torch.dtype) -> bool:
    """Whether the CUDA device computes ``dtype`` natively. Checked on a machine without a usable CUDA
    device (``check --device cuda`` on a login node) it cannot be asked, and bf16 is assumed: every GPU
    since Ampere has it, and the run itself decides on its own device."""
    if dtype != torch.bfloat16:
        return True  # float32 and float16 run natively on every CUDA device torch supports
    try:
        if not torch.cuda.is_available():
            return True
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except (AssertionError, RuntimeError):  # a CPU-only build, a device that cannot be queried
        return True


def is_native(dtype: torch.dtype, device_type: str) -> bool:
    """Whether ``device_type`` computes ``dtype`` natively (for a CPU: capability and measurement agree)."""
    if dtype == torch.float32:
        return True
    if device_type == "cuda":
        return cuda_native(dtype)
    if not cpu_capability(dtype):
        return False
    return cpu_speed_ratio(dtype)[1] >= _NATIVE_FRACTION


def choose_compute_dtype(requested: str | torch.dtype, device_type: str) -> DtypeChoice:
    """``requested`` (``"auto"`` or an explicit dtype) resolved for ``device_type`` (``cpu`` or ``cuda``)."""
    if isinstance(requested, torch.dtype):
        return DtypeChoice(requested, _name(requested), "as configured")
    if requested != AUTO:
        raise ValueError(f"choose_compute_dtype takes 'auto' or a torch.dtype, not {requested!r}")
    if device_type == "cuda":
        if not torch.cuda.is_available():  # `check --device cuda` on a machine without a GPU
            return DtypeChoice(
                torch.bfloat16,
                AUTO,
                "assumed for a CUDA device (checked on a machine without one; every GPU since Ampere computes "
                "bf16 natively, the run decides on its own device)",
            )
        if cuda_native(torch.bfloat16):
            return DtypeChoice(torch.bfloat16, AUTO, "this CUDA device computes bf16 natively")
        return DtypeChoice(torch.float32, AUTO, "this CUDA device has no native bf16")
    if not cpu_capability(torch.bfloat16):
        return DtypeChoice(
            torch.float32,
            AUTO,
            "this CPU has no native bf16 (no AVX512_BF16/AMX): bf16 would be emulated, far slower than float32",
        )
    gflops, ratio = cpu_speed_ratio(torch.bfloat16)
    if ratio >= _NATIVE_FRACTION:
        return DtypeChoice(
            torch.bfloat16,
            AUTO,
            f"this CPU computes bf16 natively: a bf16 matmul measured {ratio:.1f}x float32's speed, "
            f"{gflops:.0f} GFLOP/s on one thread",
        )
    return DtypeChoice(
        torch.float32,
        AUTO,
        f"this CPU reports bf16 support but a bf16 matmul measured {ratio:.2f}x float32's speed",
    )


def emulation_warning(dtype: torch.dtype, device_type: str) -> str | None:
    """A warning when an explicitly configured 16-bit ``dtype`` is emulated on ``device_type`` (None when
    it is native or float32): the measured slowdown and the key to change."""
    if dtype == torch.float32 or is_native(dtype, device_type):
        return None
    if device_type == "cuda":
        return (
            f"{KEY} = {_name(dtype)}: this CUDA device has no native {_name(dtype)}; set {KEY}: auto "
            "(or float32) to compute in float32."
        )
    slow = 1.0 / max(cpu_speed_ratio(dtype)[1], 1e-9)
    return (
        f"{KEY} = {_name(dtype)}: this CPU has no native {_name(dtype)} matmuls and emulates them: a "
        f"{_SIZE // 2}x{_SIZE // 2} matmul measured {slow:.0f}x slower than in float32 here (larger ones fare "
        f"worse, up to ~100x), and training slows down about as much. It trains as asked; set {KEY}: auto "
        "(or float32) to compute in float32 on this machine."
    )
