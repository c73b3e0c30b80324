"""glibc allocator defaults (utils/malloc.py): freed memory stays in the process, unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmforge.utils.malloc import is_glibc, user_choice


def test_the_users_settings_win():
    assert user_choice({}) is None
    assert user_choice({"PATH": "/bin", "LD_PRELOAD": ""}) is None
    assert user_choice({"LMFORGE_MALLOC": "default"}) == "LMFORGE_MALLOC=default"
    assert user_choice({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_ is set"
    assert user_choice({"MALLOC_ARENA_MAX": "2"}) == "MALLOC_ARENA_MAX is set"
    assert user_choice({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=1"}) == "GLIBC_TUNABLES sets glibc.malloc"
    assert user_choice({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) is None
    assert user_choice({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "jemalloc is preloaded"


# Allocates and frees a 64 MiB tensor twenty times after lmforge's CLI start-up and the imports of a
# training process, and prints how many of the last ten rounds faulted in at least half the block again.
# The heap settles in the first rounds: while small allocations land in the freed block its rest no longer
# fits and the heap grows once more; that took up to six rounds here and once a seventh in CI. After that,
# with the blocks kept in the process, there is nothing to fault in again. The training stack is imported
# as `lmforge train` imports it: with torch alone loaded (the cheap commands load nothing), glibc's heap
# may not be able to grow in place for a 64 MiB block and maps it instead, which says nothing about runs.
_PROBE = (
    "import resource\n"
    "from lmforge.cli import main\nfrom lmforge.utils import malloc\n"
    "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
    "import torch\nimport lmforge.train.builder\n"
    "faults = []\n"
    "for _ in range(20):\n"
    "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "    t = torch.ones(16 << 20)\n"
    "    del t\n"
    "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    "print(sum(f > 8192 for f in faults[10:]))\n"
    "print(malloc.status)\n"
)


def _probe(extra: dict[str, str]) -> tuple[int, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "LMFORGE_MALLOC", "GLIBC_TUN"))
    }
    env.update(extra, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    faults, status = out.stdout.strip().splitlines()[-2:]
    return int(faults), status


@pytest.mark.slow
@pytest.mark.skipif(not is_glibc(), reason="the defaults apply to glibc only")
def test_freed_blocks_are_not_faulted_in_again():
    kept, status = _probe({})
    assert "kept in the process" in status
    released, status_off = _probe({"LMFORGE_MALLOC": "default"})
    assert "LMFORGE_MALLOC=default" in status_off
    # 64 MiB are 16,384 pages: glibc's defaults map and unmap the block every round.
    assert released == 10, released
    assert kept <= 2, kept
