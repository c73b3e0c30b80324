"""Pipeline-parallel step time of this tree against another tree of lmforge, side by side.

    git archive <commit> src bench | tar -x -C /tmp/base
    python bench/pp_step.py --baseline /tmp/base [--runs 3] [--steps 5] [--no-write]

Each run spawns 2 gloo ranks that import lmforge from one tree (``src/`` and ``bench/`` of it) and
time the training step of ``plan_step_time.py``'s tiny Qwen3 (2 layers, hidden 256, seq 256, fp32,
global batch 4, 2 micro-batches) on a 2-stage 1F1B pipeline, built as the trainer builds it
(``plan_step_time._build_step``). Runs alternate between the two trees, so that a busy spell of the
shared machine hits both; each keeps its fastest step. The ratio (this tree / baseline) of the fastest
steps is written to docs/benchmarks.md ("Pipeline step: schedule called from the step").

What it shows: whether running the schedule from the train step (issue 14) costs or saves time
against the previous construction (a patched forward that ran it), on this CPU. What it does not
show: GPU numbers or pipeline bubbles at scale (two ranks, two micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PIPELINE = {"pipeline_parallel": 2, "pipeline_parallel_schedule": "1f1b"}


def _worker(rank: int, world: int, tree: str, init: str, out: str, steps: int) -> None:
    sys.path[:0] = [f"{tree}/src", f"{tree}/bench"]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        import plan_step_time as bench

        step, batches = bench._build_step(rank, world, bench._raw(dict(PIPELINE)))
        best = min(bench._time_steps(step, batches, steps, dist.barrier) for _ in range(3))
        Path(out, f"rank{rank}.json").write_text(json.dumps({"step_s": best}))
    finally:
        dist.destroy_process_group()


def _one_run(tree: Path, steps: int) -> float:
    """The fastest step of one 2-rank run importing lmforge from ``tree`` (a subprocess of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        bench_dir, args = str(HERE / "bench"), (2, str(tree), f"{tmp}/init", tmp, steps)
        code = (
            f"import sys; sys.path.insert(0, {bench_dir!r}); import pp_step, torch.multiprocessing as mp; "
            f"mp.start_processes(pp_step._worker, args={args!r}, nprocs=2, start_method='spawn')"
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tree}/src")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=600)
        return json.loads(Path(tmp, "rank0.json").read_text())["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline", required=True, type=Path, help="another lmforge tree (with src/ and bench/)"
    )
    ap.add_argument(
        "--baseline-name", default="baseline", help="how the table names the baseline (e.g. its commit)"
    )
    ap.add_argument("--runs", type=int, default=3, help="alternating runs per tree")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round (3 rounds per run)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    base = args.baseline_name
    times: dict[str, list[float]] = {base: [], "this tree": []}
    for _ in range(args.runs):
        times[base].append(_one_run(args.baseline.resolve(), args.steps))
        times["this tree"].append(_one_run(HERE, args.steps))
    best = {k: min(v) for k, v in times.items()}
    ratio = best["this tree"] / best[base]
    lines = [
        "## Pipeline step: schedule called from the step",
        "",
        f"`python bench/pp_step.py --baseline <tree>` on {platform.machine()} {platform.processor() or ''}"
        f" ({os.cpu_count()} cores, shared; load average {os.getloadavg()[0]:.1f} at the end). "
        "2 gloo ranks, PP 2 (1F1B), tiny Qwen3 of plan_step_time.py, fastest step of "
        f"{args.runs} alternating runs per tree.",
        "",
        "| tree | fastest step (s) | all runs (s) |",
        "|---|---:|---|",
    ]
    for name, values in times.items():
        lines.append(f"| {name} | {best[name]:.4f} | {', '.join(f'{v:.4f}' for v in values)} |")
    lines += ["", f"Ratio this tree / {base}: **{ratio:.3f}** (below 1: faster)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(HERE / "bench"))
        from benchdoc import write_section

        write_section("## Pipeline step: schedule called from the step", text)


if __name__ == "__main__":
    main()
