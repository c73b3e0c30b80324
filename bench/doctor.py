"""The live training doctor's cost: the same run with ``monitor.doctor`` off, at its default interval
(50 steps) and checking every step (the worst case), side by side.

    .venv/bin/python bench/doctor.py [--steps N] [--rounds R] [--no-write]

A small Qwen3 (4 layers, hidden 128, seq 128, batch 4, fp32) on learnable synthetic token data,
built by the real builders and trained by the real trainer on one process; the three variants
alternate in each round (background load hits them alike). Reported: the median wall time from one
step's end to the next (the step and all callbacks, the doctor's checks included; the metrics'
``step_time`` covers the step alone) over all rounds, first 5 steps of each run skipped, and its ratio
to "off"; and the mean, which carries the periodic checks that a median hides. A small model
is the unfavourable case: the doctor's work per check does not shrink with the model.

Writes the "## Training doctor overhead" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchdoc import write_section

VOCAB = 512


def _data(prefix: Path) -> None:
    from lmforge.data import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(2000):
            start, step, n = int(rng.integers(1, VOCAB)), int(rng.integers(1, 7)), int(rng.integers(20, 200))
            writer.add_document([1 + (start + step * i) % (VOCAB - 1) for i in range(n)] + [0])


def _config(tmp: Path, name: str, steps: int, doctor: dict) -> dict:
    return {
        "output_dir": str(tmp / name),
        "training": {"steps": steps, "local_batch_size": 4, "global_batch_size": 4, "seed": 1},
        "optimizer": {"type": "AdamW", "weight_decay": 0.01},
        "lr_scheduler": {
            "type": "CosineWithWarmUpLR",
            "learning_rate": 3e-3,
            "warmup_steps": 5,
            "lr_end": 3e-4,
        },
        "checkpoint": {"enable_save": False},
        "monitor": {"doctor": doctor, "tensorboard": {"output_dir": str(tmp / name / "tb")}},
        "model": {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            "num_hidden_layers": 4,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 384,
            "vocab_size": VOCAB,
            "seq_length": 128,
            "compute_dtype": "float32",
        },
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "datasets_type": "GPTDataset",
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
                "shuffle": True,
                "config": {
                    "seq_length": 128,
                    "eod": 0,
                    "data_path": [str(tmp / "data" / "docs")],
                    "split": "100,0,0",
                    "create_attention_mask": False,
                    "path_to_cache": str(tmp / "cache"),
                },
            },
            "num_parallel_workers": 0,
        },
    }


class _WallClock:
    """Wall time between consecutive step ends: the step and every callback (the metrics' step_time
    covers the step alone, not the callbacks the doctor runs in)."""

    order = 99

    def __init__(self) -> None:
        self.last: float | None = None
        self.times: list[float] = []

    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, *args, **kwargs) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def _run(tmp: Path, name: str, steps: int, doctor: dict) -> list[float]:
    from lmforge.config import load_config
    from lmforge.train.builder import build_trainer

    trainer = build_trainer(load_config(_config(tmp, name, steps, doctor)), device="cpu")
    clock = _WallClock()
    trainer.callbacks.add(clock)
    trainer.fit()
    return clock.times[5:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = {
        "off": {"enable": False},
        "default (every 50 steps)": {"enable": True},
        "every step": {"enable": True, "check_interval": 1},
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "data").mkdir()
        _data(tmp / "data" / "docs")
        for r in range(args.rounds):
            for i, (name, doctor) in enumerate(variants.items()):
                times[name] += _run(tmp, f"r{r}v{i}", args.steps, doctor)
    base = statistics.median(times["off"])
    rows = [(name, statistics.median(t), statistics.mean(t)) for name, t in times.items()]
    mean_base = statistics.mean(times["off"])
    body = [
        "## Training doctor overhead",
        "",
        f"`bench/doctor.py --steps {args.steps} --rounds {args.rounds}`: a 4-layer Qwen3 (hidden 128, seq 128, "
        "batch 4, fp32) on one process, 1 thread; the live doctor off, at its default interval, and checking "
        f"every step; wall time per step (step and callbacks) over {args.rounds} alternating rounds. Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared), torch {torch.__version__}.",
        "",
        "| doctor | median step wall time (ms) | ratio to off | mean (ms) | ratio to off |",
        "|---|---:|---:|---:|---:|",
    ]
    body += [
        f"| {n} | {1e3 * t:.2f} | {t / base:.3f} | {1e3 * m:.2f} | {m / mean_base:.3f} |" for n, t, m in rows
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if not args.no_write:
        write_section("## Training doctor overhead", text)


if __name__ == "__main__":
    main()
