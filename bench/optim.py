"""Optimizer step time: lmforge's AdamW and Muon against torch's, same process, same tensors.

    .venv/bin/python bench/optim.py [--repeats N] [--models demo,100m] [--no-write]

For each model's parameter shapes it times ``optimizer.step()`` (median of repeats, ours and torch's
interleaved so background load hits both alike) and prints the ratio ours / torch:

* AdamW, fp32 parameters: ours vs torch's fastest variant, ``torch.optim.AdamW(fused=True)`` (issue 15:
  compare with the peer in its fastest form, not its default foreach path).
* Muon on the 2-D hidden matrices (torch's Muon takes 2-D only; no split schema, so both do the same
  Newton-Schulz work): ours (batched by shape) vs ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``.

The table replaces the "## Optimizer step" section of docs/benchmarks.md (other sections untouched).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from benchdoc import write_section
from lmforge.optim import AdamW, Muon

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "## Optimizer step"


def transformer_shapes(vocab, hidden, layers, ffn, q_rows, kv_rows, head_dim=None, tied=True):
    """Parameter shapes of a Megatron-style decoder (fused QKV, SwiGLU fc1 = 2*ffn rows)."""
    hidden_mats, others = [], [(vocab, hidden)]
    if not tied:
        others.append((vocab, hidden))
    for _ in range(layers):
        hidden_mats += [(q_rows + 2 * kv_rows, hidden), (hidden, q_rows), (2 * ffn, hidden), (hidden, ffn)]
        others += [(hidden,), (hidden,)]
        if head_dim:
            others += [(head_dim,), (head_dim,)]
    others.append((hidden,))
    return hidden_mats, others


MODELS = {
    # configs/demo.yaml: qwen3, hidden 256, 4 layers, 4 heads / 2 KV heads of 64, ffn 768, vocab 8192, tied.
    "demo": transformer_shapes(8192, 256, 4, 768, 4 * 64, 2 * 64, head_dim=64),
    # ~110M parameters: hidden 768, 12 layers, 12 heads of 64 (MHA), SwiGLU ffn 2048, vocab 32000, tied.
    "100m": transformer_shapes(32000, 768, 12, 2048, 768, 768),
}


def make_params(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype)) for s in shapes]


def set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def time_pair(make_ours, make_theirs, params_ours, params_theirs, repeats):
    """(median ours s, median theirs s, median of the per-round ratios, the same of CPU time).

    Each round times one step of each back to back; the ratio of a round is insensitive to load that
    changes slower than a round, which matters on a shared machine. The CPU-time ratio (user + system
    time of this process, page faults included) is barely touched by other processes taking the cores,
    so on a loaded machine it is the better estimate of the idle machine's wall-time ratio.
    """
    ours, theirs = make_ours(), make_theirs()
    set_grads(params_ours, 0)
    set_grads(params_theirs, 0)
    ours.step()  # warm-up (kernel selection, lazy state in torch's optimizers)
    theirs.step()
    t_ours, t_theirs, c_ours, c_theirs = [], [], [], []
    for r in range(repeats):
        for opt, params, out, cpu in (
            (ours, params_ours, t_ours, c_ours),
            (theirs, params_theirs, t_theirs, c_theirs),
        ):
            set_grads(params, r + 1)
            start, start_cpu = time.perf_counter(), time.process_time()
            opt.step()
            out.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    ratios = [a / b for a, b in zip(t_ours, t_theirs)]
    cpu_ratios = [a / b for a, b in zip(c_ours, c_theirs)]
    return (
        statistics.median(t_ours),
        statistics.median(t_theirs),
        statistics.median(ratios),
        statistics.median(cpu_ratios),
    )


def bench_model(name, repeats):
    hidden, others = MODELS[name]
    shapes = hidden + others
    n_params = sum(torch.Size(s).numel() for s in shapes)
    rows = []

    a, b = make_params(shapes, torch.float32), make_params(shapes, torch.float32)
    t = time_pair(
        lambda: AdamW(a, lr=1e-3, weight_decay=0.1),
        lambda: torch.optim.AdamW(b, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True),
        a,
        b,
        repeats,
    )
    rows.append((name, n_params, "AdamW, fp32 params", "torch AdamW fused (fp32)", *t))
    del a, b

    n_hidden = sum(torch.Size(s).numel() for s in hidden)
    a, b = make_params(hidden, torch.float32), make_params(hidden, torch.float32)
    t = time_pair(
        lambda: Muon(a, lr=0.02, qk_clip_enabled=False),
        lambda: torch.optim.Muon(b, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        a,
        b,
        max(5, repeats // 2),
    )
    rows.append((name, n_hidden, "Muon, 2-D hidden matrices", "torch Muon (match_rms_adamw)", *t))
    return rows


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = re.search(r"Model name:\s*(.+)", out)
        cpu = model.group(1).strip() if model else platform.processor()
    except OSError:
        cpu = platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def render(rows, repeats, runs) -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=False
        ).stdout.strip()
    except OSError:
        commit = "?"
    lines = [
        SECTION,
        "",
        f"`bench/optim.py --runs {runs}` (every configuration measured {runs} times, one row per run; each run",
        f"{repeats} rounds for AdamW and {max(5, repeats // 2)} for Muon, each one step of ours and one of torch's back to back, in one process on the same",
        "shapes and gradients; times are medians, the ratio is the median of the per-round ratios;",
        f"commit {commit}). Machine: {machine()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}. "
        f"Load average at start: "
        f"{LOAD_AT_START:.1f}, at the end: {os.getloadavg()[0]:.1f} (the machine is shared, so absolute times are noisy; "
        "the ratio is the result, and the CPU-time ratio is the one least disturbed by other processes).",
        "",
        "| run | threads | model | parameters | ours | peer | ours ms | peer ms | ratio | target | CPU-time ratio |",
        "|---:|---:|---|---:|---|---|---:|---:|---:|---|---:|",
    ]
    for run, threads, model, n, ours, peer, t_ours, t_peer, ratio, cpu_ratio in sorted(
        rows, key=lambda r: r[1:3]
    ):
        target = 0.9 if ours.startswith("Muon") else 1.05
        verdict = "met" if ratio <= target else "**missed**"
        lines.append(
            f"| {run} | {threads} | {model} | {n / 1e6:.1f}M | {ours} | {peer} | {t_ours * 1e3:.1f} | {t_peer * 1e3:.1f} | "
            f"{ratio:.2f}x | <= {target}x {verdict} | {cpu_ratio:.2f}x |"
        )
    lines += [
        "",
        "Targets (issue 15): AdamW <= 1.05x torch's fused AdamW; Muon <= 0.9x torch's Muon. Parameters are fp32 on "
        "every layout (they are the master weights), so there is no bf16-parameter case.",
        "",
        "Why: ours runs the same fused AdamW kernel as the peer (one pass over each tensor), so the ratio is the",
        "cost of our bookkeeping around it. Both Muons compute the same update with bf16 Newton-Schulz. Ours",
        "casts the Nesterov sum once into kept per-shape buffers, iterates small shapes together in batched",
        "matmuls and large ones one matrix at a time into reused scratch, runs tall matrices on the right",
        "(no transposed copies), and computes the symmetric Gram matrix X X^T and b P + c P^2 block-triangle",
        "only (3 blocks at 768 rows: 2/3 of those products' FLOPs), one column panel (diagonal block and all",
        "below it) per matmul; torch's Muon runs three full matmuls per iteration on fresh tensors.",
        "",
        "Panels instead of blocks (this round): 3 matmuls instead of 6 per product at 768 rows, same FLOPs and the",
        "same bits (the whole step's parameters bitwise equal). Gram + polynomial alone, CPU time against the whole",
        "products: panels 0.78-0.93x, blocks 0.81-0.99x at 2 threads (768 x 768 .. 4096 x 768); whole 100M step",
        "at 2 threads, both variants alternating in one process: panels 0.97x CPU time, 0.94x wall of blocks.",
        "Recorded runs: commit 241a888 (blocks, load 3.6-6.7): Muon 0.84-0.96x, 5 of 8 rows <= 0.9x; commit b0691bf",
        "(panels, load 3.1-7.0): 0.88-0.93x, 3 of 8 (100M at 2 threads 0.91/0.88, CPU time 0.84/0.88). Single",
        "rows move by +-0.05 between runs with the load, so the demo rows (0.88-0.96x over both recordings, 0.92-0.96x at 1 thread) are the ones",
        "still short of 0.9x on this machine.",
        "At the demo's 256-row Gram matrices both lose (panels 1.0-2.2x, blocks 1.3-3.9x the whole products), so",
        "the demo runs whole products as before: its step is 85-90% matmuls in which ours is already 0.87-0.90x",
        "torch's (batching), and the rest is casts, momentum and the update (about 8 ms of 57 at 1 thread).",
        "",
        "Muon before this work (commit 142fadf, idle machine, 7 rounds): 1.18x (demo, 1 thread), 1.28x (100M, 1",
        "thread), 0.72x (demo, 2 threads), 1.31x (100M, 2 threads). Newton-Schulz alone per shape after it (CPU time,",
        "1 thread, 9 interleaved rounds, load 3.3): 0.85-0.90x torch's at the 100M shapes (768 x 768, 2304 x 768,",
        "4096 x 768, 768 x 2048), 0.88-0.98x at the demo shapes (256 rows: too small for the blocked products, so",
        "only batching saves there). The whole step lands around 0.84-0.96x depending on load; on this shared",
        "2-core machine the same unchanged AdamW moves 0.93-1.18x between runs, so single rows near 0.9 are not",
        "decisive either way.",
        "",
        "Profile behind it (torch.profiler, `record_shapes=True`, grouped by op and shape; 100M, 1 thread, before",
        "the change, 4.66 s against torch's 3.60 s unprofiled). Beyond torch's, ours spent its time in: transposed",
        "bf16 copies when stacking tall matrices and putting results back (`copy_`/`cat` of `[12, 768, 4096]`,",
        "`[12, 768, 2304]`, `[1, 4096, 768]`: about 10 s of the 22 s profiled step, against torch's 0.3 s of",
        "copies); out-of-place `baddbmm` writing fresh 75 MB tensors (a fresh 75 MB bf16 tensor measured 70 ms",
        "to fill against 10 ms for an existing one: page faults); fp32 temporaries (`g + mu m`, the scaled",
        "update, the norm's fp32 copy of X: 47 ms per 4096 x 768 add against torch's 3 ms `lerp`); and `bmm` on",
        "large shapes (12 x 768 x 4096: 181 ms against 131 ms for 12 `mm`). Torch's own extra is its fp32 copies",
        "of each bf16 update (about 0.2 s). After the change the matmuls are all that is left of both steps",
        "but a few percent: the mirror copies of the blocked products (2.7% of the profiled step) and the casts",
        "in and out of the buffers (about 2%).",
        "",
        "Tried and dropped: Gram Newton-Schulz (iterate on P = X X^T, one large product at each end) needs 0.63x",
        "of the FLOPs at 100M but in bf16 it drifted (relative error to an fp64 run 27% at 768 x 4096, against",
        "4.7% for the standard iteration; 10.7% with a restart after two steps), and fp32 matmuls are 5-9x",
        "slower than bf16 on this CPU (768^3: 18 ms against 2.1 ms). Stacking large shapes into `bmm` also lost",
        "to one `mm` per matrix at 1 thread. Folding a into the polynomial (X (a I + Q): one plain matmul, no copy",
        "of X into the output) doubles the bf16 error against an fp64 iteration (1.1% -> 2.1% at every shape), so it",
        "is not used. Stacking the demo's four 1536 x 256 matrices into one bmm: 1.00-1.05x of one mm each (whole",
        "step, 1 thread), no gain. Note OMP_WAIT_POLICY: without PASSIVE, 2 threads on this loaded 2-core machine",
        "spin against other processes (a 100M step took 25 s instead of 3).",
        "",
    ]
    return "\n".join(lines)


LOAD_AT_START = os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runs", type=int, default=2, help="measure every configuration this many times")
    ap.add_argument("--models", default="demo,100m")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts to run")
    args = ap.parse_args()
    rows = []
    for run in range(1, args.runs + 1):
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for name in args.models.split(","):
                rows += [(run, threads, *row) for row in bench_model(name, args.repeats)]
                print(rows[-1], flush=True)
    text = render(rows, args.repeats, args.runs)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"updated {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
