"""OpenMP defaults set by the CLI before torch loads (lmforge.cli.threads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmforge.cli.threads import thread_defaults


def test_defaults_on_a_bare_environment():
    assert thread_defaults({}, cores=8) == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "8"}


def test_user_settings_win():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3"}
    assert thread_defaults(env, cores=8) == {}
    # A plain OMP_NUM_THREADS=1 outside torchrun is the user's own choice.
    assert thread_defaults({"OMP_NUM_THREADS": "1"}, cores=8) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_per_rank_threads_under_torchrun():
    # torchrun's own OMP_NUM_THREADS=1 is replaced by cores / processes on this node.
    env = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4"}
    assert thread_defaults(env, cores=16)["OMP_NUM_THREADS"] == "4"
    assert thread_defaults({**env, "LOCAL_WORLD_SIZE": "4"}, cores=2)["OMP_NUM_THREADS"] == "1"
    # A user's explicit value other than 1 is kept under torchrun too.
    assert "OMP_NUM_THREADS" not in thread_defaults({**env, "OMP_NUM_THREADS": "2"}, cores=16)
    # LMFORGE_NUM_THREADS forces the count (the way to ask for 1 thread per rank under torchrun).
    assert thread_defaults({**env, "LMFORGE_NUM_THREADS": "1"}, cores=16)["OMP_NUM_THREADS"] == "1"


_PROBE = (
    "import os\n"
    "from lmforge.cli import main\n"
    "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
    "import torch\n"
    "print(os.environ['OMP_WAIT_POLICY'], os.environ['OMP_NUM_THREADS'], torch.get_num_threads())\n"
)


def _probe(extra: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "LMFORGE_", "TORCHELASTIC_"))}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-3:]


@pytest.mark.slow
def test_cli_sets_values_before_torch_loads():
    policy, omp, torch_threads = _probe({"LOCAL_WORLD_SIZE": "1"})
    assert policy == "PASSIVE"
    assert omp == torch_threads == str(len(os.sched_getaffinity(0)))


@pytest.mark.slow
def test_cli_keeps_the_users_values():
    assert _probe({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}) == ["ACTIVE", "1", "1"]
