"""glibc allocator settings for training on CPUs: keep freed memory in the process, as a caching allocator does.

torch's CPU allocator is plain ``malloc``. glibc gives large freed blocks back to the kernel: blocks above
the mmap threshold (which adapts up to 32 MiB) are unmapped on ``free``, and free memory at the top of the
heap is trimmed. A training step frees and allocates the same buffers every step (activations, FSDP2's
compute copies and gradient buffers, the loss chunks' logits), so each step then pays a page fault, and
the kernel's zeroing, for every 4 KiB page of them again: at 100M parameters on 2 cores about 300,000
faults and a quarter of the step (docs/benchmarks.md, "Allocator"). CUDA's caching allocator avoids this on
GPUs; on CPUs Intel's tuning guide preloads jemalloc or tcmalloc. lmforge asks glibc itself, through
``mallopt``, to behave like one:

* ``M_MMAP_MAX = 0``: every block comes from the heap, none from its own mapping (a request the heap
  cannot grow for still falls back to a mapping inside glibc);
* ``M_TRIM_THRESHOLD`` at its maximum: free memory at the heap's top stays there for the next step.

The process's resident memory stays at its high-water mark instead of following every ``free`` (what a
caching allocator does; peak memory is unchanged). Nothing is changed when the user chose otherwise: any
``MALLOC_*_`` tuning variable, ``GLIBC_TUNABLES`` naming ``glibc.malloc``, another allocator in
``LD_PRELOAD``, or ``LMFORGE_MALLOC=default``; nor on a C library other than glibc. ``mallopt`` takes
effect at any time, so unlike the thread defaults this may run after torch is loaded; processes forked
later (data-loader workers) inherit it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

# From glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1

USER_VARIABLES = (
    "MALLOC_ARENA_MAX",
    "MALLOC_ARENA_TEST",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_TRIM_THRESHOLD_",
)
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

# What apply_malloc_defaults did in this process (``lmforge env`` reports it).
status = "not applied"


def user_choice(env: Mapping[str, str]) -> str | None:
    """Why the user's own allocator settings win, or None when there are none."""
    if env.get("LMFORGE_MALLOC", "").strip().lower() == "default":
        return "LMFORGE_MALLOC=default"
    for name in USER_VARIABLES:
        if name in env:
            return f"{name} is set"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = env.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} is preloaded"
    return None


def is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):  # no confstr (Windows) or no such name (macOS, musl)
        return False


def apply_malloc_defaults(env: Mapping[str, str] | None = None) -> str:
    """Keep freed memory in the process (see the module docstring); returns what was done, in words."""
    global status
    env = os.environ if env is None else env
    reason = user_choice(env)
    if reason is not None:
        status = f"glibc defaults or the user's ({reason})"
    elif not is_glibc():
        status = "not glibc: unchanged"
    else:
        libc = ctypes.CDLL(None)
        done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
        status = (
            "freed memory kept in the process (M_MMAP_MAX=0, M_TRIM_THRESHOLD=max)"
            if done
            else ("mallopt refused: glibc defaults")
        )
    return status
