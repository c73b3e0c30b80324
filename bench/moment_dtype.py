"""Optimizer-state compression on the demo: the demo run (configs/demo.yaml, 160 steps) with fp32
moments and with ``optimizer.moment_dtype: bfloat16``, side by side (the same data order and seed).

Reports the final training loss (mean of the last 10 steps), the final validation loss, the bytes
of the optimizer moments and the wall time of each run, and writes the "Optimizer-state
compression" section of docs/benchmarks.md. The issue's target: final loss within 2 % of the fp32
states.

    lmforge data demo --output data/demo && python bench/moment_dtype.py [--optimizer Muon] [--steps 160]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from benchdoc import write_section  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.train.builder import build_trainer  # noqa: E402
from lmforge.train.callbacks import read_metrics  # noqa: E402

TITLE = "## Optimizer-state compression"
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def run(moment_dtype: str, optimizer: str, steps: int, seed: int, out: Path) -> dict:
    overrides = [
        f"training.seed={seed}",
        f"optimizer.moment_dtype={moment_dtype}",
        f"output_dir={out}",
        "checkpoint.enable_save=false",
        f"training.steps={steps}",
        f"eval_interval={steps}",
        f"monitor.tensorboard.output_dir={out / 'tensorboard'}",
    ]
    if optimizer == "Muon":
        overrides += ["optimizer.type=Muon", "optimizer.qk_clip_enabled=false", "optimizer.betas=null"]
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides)
    trainer = build_trainer(cfg, device="cpu")
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    records = read_metrics(trainer.output_dir / "metrics.jsonl")
    moment_bytes = sum(
        t.numel() * t.element_size()
        for st in trainer.optimizer.state.values()
        for k, t in st.items()
        if k in MOMENTS
    )
    val = [r[k] for r in records for k in r if k.startswith("val_loss")]
    return {
        "seed": seed,
        "moment_dtype": moment_dtype,
        "final_loss": sum(r["loss"] for r in records[-10:]) / len(records[-10:]),
        "val_loss": val[-1] if val else float("nan"),
        "moment_bytes": moment_bytes,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizer", default="AdamW", choices=["AdamW", "Muon"])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[42], help="training.seed values (initial weights)"
    )
    ap.add_argument("--no-doc", action="store_true", help="print only; do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.chdir(REPO)  # the demo's data paths are relative to the repository
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for dt in ("float32", "bfloat16"):
                rows.append(run(dt, args.optimizer, args.steps, seed, Path(tmp) / f"{dt}_{seed}"))
                print(rows[-1], flush=True)
    pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        TITLE,
        "",
        f"`bench/moment_dtype.py --optimizer {args.optimizer} --steps {args.steps}` (commit {commit}). Machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads. Load average at start: {load:.1f} (shared machine: wall times are noisy).",
        "The demo run (configs/demo.yaml: Qwen3-style, 1.8M parameters, bf16 compute, 8 x 256 tokens per "
        "step) with fp32 moments and with `optimizer.moment_dtype: bfloat16` (stored in bf16, updated in "
        "fp32, stochastic rounding); each pair shares `training.seed` (the initial weights; the data order is the same in every run). "
        "Different seeds show how much the final loss varies for reasons other than the moments.",
        "",
        "| seed | moments | final train loss (last 10 steps) | final val loss | moment bytes | wall time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['moment_dtype']} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | "
            f"{r['moment_bytes'] / 2**20:.2f} MiB | {r['wall_s']:.0f} s |"
        )
    lines.append("")
    for ref, comp in pairs:
        lines.append(
            f"* seed {ref['seed']}: bf16 moments give a final training loss "
            f"{comp['final_loss'] / ref['final_loss'] - 1:+.2%} and a final validation loss "
            f"{comp['val_loss'] / ref['val_loss'] - 1:+.2%} relative to fp32 moments (target: within ±2 %); "
            f"moment memory {comp['moment_bytes'] / ref['moment_bytes']:.2f}x."
        )
    if len(pairs) > 1:
        fp32 = [ref["val_loss"] for ref, _ in pairs]
        lines.append(
            f"* seed to seed (fp32 moments), the final validation loss spans {min(fp32):.4f}–{max(fp32):.4f} "
            f"({max(fp32) / min(fp32) - 1:.2%})."
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
