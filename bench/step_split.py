"""Where a training step's time goes in each loop, and what the throughput targets leave for the rest
(issue 35).

    PYTHONPATH=src .venv/bin/python bench/step_split.py [--models demo,100m] [--rounds 4] [--no-write]

Both loops are built exactly as ``bench/train.py`` builds them (same weights, batch, dtype, threads,
allocator). Per loop, wall-clock medians of:

* the whole step (lmforge's ``TrainStep``; the HF loop's autocast step with clipping and fused AdamW);
* forward, as the step runs it (lmforge's includes its chunked loss, which computes the logits'
  gradients in forward; the HF loop's ends at the loss);
* backward (``objective.backward()``);
* the rest of the step (clipping, optimizer, bookkeeping) as step - forward - backward.

Rounds alternate the loops so background load hits both. Then ``bench/matmul_shapes.py``'s census gives
the time both loops spend in matmuls and SDPA, each distinct call timed alone on the same shapes and
strides: the *shared* work, which runs the same oneDNN and flash-attention kernels in both loops at the
same speed per FLOP. What is left of a step beyond it is each loop's *own* work (casts, norms, RoPE,
SwiGLU's elementwise ops, the loss's softmax, the optimizer, FSDP2's hooks and copies). For a target
ratio ``r`` of lmforge's throughput over the HF loop's, lmforge's own work must fit in
``HF step / r - lmforge's shared work``; the table prints that budget next to what lmforge spends now.

Writes the "## Step split" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import matmul_shapes as shapes  # bench/matmul_shapes.py
import train as bench  # bench/train.py
from benchdoc import replace_section
from lmforge.models.common.loss import loss_gradient_scale
from lmforge.utils import malloc

SECTION = "## Step split"
# Issue 35's eager targets: lmforge's tokens/s over the eager HF loop's.
TARGETS = {"demo": 1.3, "100m": 1.05}


def lmforge_phases(model, batch: dict, tokens: int):
    """One forward and one backward as ``TrainStep`` runs them (the announced gradient scale, the token
    mean as the objective); returns (forward s, backward s). Gradients are dropped afterwards."""

    def run() -> tuple[float, float]:
        inv_tokens = 1.0 / tokens
        t0 = time.perf_counter()
        with loss_gradient_scale(inv_tokens):
            out = model(**batch)
        t1 = time.perf_counter()
        (out.loss_sum * inv_tokens).backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    return run


def hf_phases(model, ids: torch.Tensor):
    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    return run


def shared_time(loops: dict, repeats: int) -> dict[str, float]:
    """Seconds per step each loop spends in matmul-family and SDPA calls, each call timed alone."""
    tensors_of: dict = {}
    per_call: dict = {}
    for calls in loops.values():
        for call in calls:
            if call not in per_call:
                per_call[call] = shapes.timed_min(shapes.replay(call, tensors_of), repeats)
    return {loop: sum(n * per_call[c] for c, n in calls.items()) for loop, calls in loops.items()}


def measure(name: str, rounds: int, repeats: int) -> dict:
    section = bench.MODELS[name]
    b, s = section["batch"], section["seq_length"]
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, section["vocab_size"], (b, s + 1), generator=g)
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].clone()}
    with tempfile.TemporaryDirectory() as tmp:
        lf_model, _, lf_step = bench.lmforge_runner(section, batch)
        hf_model, hf_step = bench.hf_runner(lf_model, {**batch, "full": full[:, :-1]}, Path(tmp))
        lf_parts, hf_parts = lmforge_phases(lf_model, batch, b * s), hf_phases(hf_model, full[:, :-1])
        lf_step(), hf_step()  # warm-up
        times: dict[str, list[float]] = {
            k: [] for k in ("lf step", "hf step", "lf fwd", "lf bwd", "hf fwd", "hf bwd")
        }
        for r in range(rounds):
            order = [("lf", lf_step, lf_parts), ("hf", hf_step, hf_parts)]
            for loop, step, parts in order if r % 2 == 0 else order[::-1]:
                for _ in range(2):
                    t = time.perf_counter()
                    step()
                    times[f"{loop} step"].append(time.perf_counter() - t)
                fwd, bwd = parts()
                times[f"{loop} fwd"].append(fwd)
                times[f"{loop} bwd"].append(bwd)
        loops = {"lmforge": shapes.census_of(lf_step), "HF": shapes.census_of(hf_step)}
    shared = shared_time(loops, repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"name": name, "median": med, "shared": shared, "samples": rounds * 2}


def render(rows: list[dict], rounds: int) -> str:
    load = os.getloadavg()[0]
    out = [
        SECTION,
        "",
        f"`bench/step_split.py` ({rounds} rounds, the loops alternating; medians of wall-clock time). Machine: "
        f"{bench.machine()}; load average {load:.1f} at the end. Forward is as each step runs it: lmforge's "
        "includes its chunked loss, which computes the logits' gradients in forward; the rest is clipping, "
        "the optimizer and bookkeeping. *Shared*: matmul-family and SDPA calls of one step, each timed alone "
        "(`bench/matmul_shapes.py`'s census), the same kernels at the same speed per FLOP in both loops. "
        "*Own*: the step minus the shared work.",
        "",
        "| model | loop | step (ms) | forward | backward | rest | shared | own | own, % of step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["median"]
        for loop, key in (("lmforge", "lf"), ("HF", "hf")):
            step, fwd, bwd = m[f"{key} step"], m[f"{key} fwd"], m[f"{key} bwd"]
            shared = r["shared"][loop]
            own = step - shared
            out.append(
                f"| {r['name']} | {loop} | {step * 1e3:.0f} | {fwd * 1e3:.0f} | {bwd * 1e3:.0f} | "
                f"{(step - fwd - bwd) * 1e3:.0f} | {shared * 1e3:.0f} | {own * 1e3:.0f} | {100 * own / step:.0f}% |"
            )
    out += [
        "",
        "What the eager targets of issue 35 leave for lmforge's own work (the HF step over the target, minus "
        "lmforge's shared work):",
        "",
        "| model | target | ratio now | lmforge's own work now (ms) | budget for it (ms) | cut needed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        target = TARGETS.get(r["name"])
        if target is None:
            continue
        m = r["median"]
        own = m["lf step"] - r["shared"]["lmforge"]
        budget = m["hf step"] / target - r["shared"]["lmforge"]
        out.append(
            f"| {r['name']} | {target:.2f}x | {m['hf step'] / m['lf step']:.2f}x | {own * 1e3:.0f} | "
            f"{budget * 1e3:.0f} | {100 * (1 - budget / own):.0f}% |"
        )
    out.append("")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="demo,100m")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--repeats", type=int, default=5, help="timings of each distinct matmul/SDPA call (fastest)"
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    malloc.apply_malloc_defaults()
    rows = [measure(name, args.rounds, args.repeats) for name in args.models.split(",")]
    text = render(rows, args.rounds)
    print(text)
    if not args.no_write:
        bench.DOC.write_text(replace_section(bench.DOC.read_text(), SECTION, text))
        print(f"updated {bench.DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
