"""Run a tiny training job under torchrun and read back what it produced."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from train.test_train_cli import ADAMW, write_config

TESTS_DIR = Path(__file__).resolve().parents[2]
SRC_DIR = TESTS_DIR.parent / "src"


def job_config(
    root: Path, steps: int = 8, faults: list[dict[str, Any]] | None = None, **sections: Any
) -> str:
    """The tiny Qwen3 of tests/train in ``root``, checkpointing every 2 steps, with injected faults."""
    root.mkdir(parents=True, exist_ok=True)
    path = Path(write_config(root, ADAMW, steps=steps))
    raw = yaml.safe_load(path.read_text())
    raw["checkpoint"].update({"save_interleaved_steps": 2, "save_max": 10})
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    if faults:
        raw["callbacks"] = [{"type": "end_to_end.elastic.faults:Fault", **f} for f in faults]
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    # The fault-injection callbacks (end_to_end.elastic.faults) are named in the YAML: this test trusts them.
    env["LMFORGE_ALLOW_IMPORTS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(SRC_DIR), str(TESTS_DIR), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def start_torchrun(args: list[str], lmforge_args: list[str], **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "lmforge", *lmforge_args]
    return subprocess.Popen(
        cmd,
        env=worker_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: kill_group ends torchrun and its workers
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a job started with ``start_new_session`` and everything it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def start_standalone(cfg: str, nproc: int = 2, max_restarts: int = 0) -> subprocess.Popen:
    """``torchrun --standalone`` (a free port per job, so jobs may run side by side)."""
    args = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
    ]
    return start_torchrun(args, ["train", "--config", cfg])


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    """(exit status, combined output) of a job started above; killed if it outlives ``timeout``."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        return -999, out + f"\n[test] killed after {timeout} s"
    return proc.returncode, out


def losses(root: Path) -> list[tuple[int, float]]:
    from lmforge.train.callbacks import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(root / "run" / "metrics.jsonl")]


def checkpoint_weights(iteration_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, gathered into one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{iteration_dir.parent.parent.name}-{iteration_dir.name}.pt"
    dcp_to_torch_save(iteration_dir, out)
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}
