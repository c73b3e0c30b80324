"""Shared fixtures: paths to the repository, the spec's YAML examples and a complete base config."""

from __future__ import annotations

import copy
import getpass
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

# A run that limits the CPU's instruction set (ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY: how
# docs/architecture.md imitates a CPU without native bf16) compiles other kernels and packs oneDNN weights
# in other layouts, but torch's inductor cache does not key on these variables: such a run's cached
# graphs, replayed by a later normal run (or the other way round), corrupted the heap ("free(): invalid
# pointer" in tests/end_to_end/speed/test_compile_fsdp.py). Each instruction-set limit gets its own cache.
_ISA_LIMITS = [
    f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if os.environ.get(k)
]
if _ISA_LIMITS and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    suffix = "_".join(_ISA_LIMITS).replace("=", "-").lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{suffix}"
    )

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC_YAMLS = REPO_ROOT / "tests" / "fixtures" / "spec_yamls"

# A complete, minimal, valid configuration (a tiny qwen3) as a plain mapping.
BASE_CONFIG: dict[str, Any] = {
    "training": {"steps": 10, "local_batch_size": 1, "global_batch_size": 2},
    "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1.0e-4, "warmup_steps": 2},
    "train_dataset": {
        "dataloader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "config": {"seq_length": 32, "data_path": ["data/none/train"], "split": "98,2,0", "eod": 0},
        }
    },
    "model": {
        "model_type": "qwen3",
        "architectures": "Qwen3ForCausalLM",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        # The data's sequence length: a run refuses a model.seq_length that differs from it.
        "seq_length": 32,
    },
}


@pytest.fixture
def base_config() -> dict[str, Any]:
    """A fresh deep copy of ``BASE_CONFIG`` for a test to modify."""
    return copy.deepcopy(BASE_CONFIG)


@pytest.fixture(autouse=True)
def _no_leftover_one_process_group():
    """Every run builds through FSDP2, on a one-process group when not under torchrun
    (``lmforge.train.parallel_seam``); a test that built a trainer leaves it behind, and the next test
    may set up its own group. Tests that run under torchrun-like groups of several ranks are untouched."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
