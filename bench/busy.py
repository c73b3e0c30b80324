"""Step time on an idle and on a busy machine: does lmforge slow down more than the HF loop?

    .venv/bin/python bench/busy.py [--rounds 3] [--steps 6] [--dtype float32] [--no-write]

Issue 35: with one competing CPU-bound process on the machine, lmforge's step time must grow no more
than the HF loop's does. Each loop runs as its own fresh process, as a user would run it:

* ``lmforge``: the thread and allocator defaults the ``lmforge`` command sets before torch loads
  (``cli/threads.py``: ``OMP_WAIT_POLICY=PASSIVE``, one share of the cores; ``utils/malloc.py``), then
  the trainer's build and ``TrainStep`` (``bench/train.py``'s ``lmforge_runner``);
* ``hf``: a plain transformers loop (``bench/train.py``'s ``hf_step``: fused AdamW, clipping, autocast
  when the dtype is 16-bit) with torch's own defaults (OpenMP threads spin while they wait);
* ``hf-passive``: the same loop with ``OMP_WAIT_POLICY=PASSIVE`` (the peer in its fastest form on a busy
  machine).

The competitor is another process training a small MLP with torch's defaults (two threads, spinning),
started before and stopped after each busy run. Runs alternate loop by loop and idle/busy, ``--rounds``
times; each run reports the median of ``--steps`` steps after two warm-up steps. Writes the
"## Busy machine" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
SECTION = "## Busy machine"

# ~25M parameters (Qwen3 layout, tied embeddings): the size the issue measured.
MODEL = {
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "seq_length": 256,
    "tie_word_embeddings": True,
    "batch": 8,
}
LOOPS = ("lmforge", "hf", "hf-passive")

COMPETITOR = """
import torch
torch.manual_seed(0)
x = torch.randn(256, 1024)
net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
opt = torch.optim.SGD(net.parameters(), lr=1e-3)
while True:
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def worker(loop: str, dtype: str, steps: int, hf_dir: Path) -> dict:
    """Run inside the child process: build one loop, time ``steps`` steps, return the times."""
    if loop == "lmforge":
        from lmforge.cli.threads import apply_thread_defaults

        apply_thread_defaults()  # what the lmforge command does before torch is imported
    import torch

    sys.path.insert(0, str(BENCH))
    import train as bench  # bench/train.py
    from lmforge.utils import malloc

    if loop == "lmforge":
        malloc.apply_malloc_defaults()
    section = {**MODEL, "compute_dtype": dtype}
    b, s = section["batch"], section["seq_length"]
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, section["vocab_size"], (b, s + 1), generator=g)
    batch = {"input_ids": full[:, :-1], "labels": full[:, 1:].clone(), "full": full[:, :-1]}
    if loop == "lmforge":
        _, _, step = bench.lmforge_runner(section, {k: v for k, v in batch.items() if k != "full"})
    else:
        step = _hf_step(hf_dir, batch, dtype)
    step(), step()  # warm-up
    times = bench.timed(step, steps)
    return {
        "loop": loop,
        "median_s": statistics.median(times),
        "times": times,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
    }


def _hf_step(hf_dir: Path, batch: dict, dtype: str):
    import torch
    import transformers

    import train as bench  # bench/train.py (on sys.path: worker() put it there)

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    return bench.hf_step(model, batch["full"], getattr(torch, dtype))


def export_hf(dtype: str, hf_dir: Path) -> None:
    """The HF loop's weights: the lmforge model's (seed 0), exported once by this parent process."""
    sys.path.insert(0, str(BENCH))
    import train as bench  # bench/train.py
    from lmforge.models import save_hf_pretrained

    model, _ = bench.lmforge_model({**MODEL, "compute_dtype": dtype})
    save_hf_pretrained(model, hf_dir)


def _env(loop: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.pop("LMFORGE_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if loop == "hf-passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def run_loop(loop: str, dtype: str, steps: int, hf_dir: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        loop,
        "--dtype",
        dtype,
        "--steps",
        str(steps),
        "--hf-dir",
        str(hf_dir),
    ]
    out = subprocess.run(cmd, check=True, env=_env(loop), capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(rounds: int, steps: int, dtype: str, hf_dir: Path) -> list[dict]:
    rows = []
    for r in range(rounds):
        for busy in (False, True) if r % 2 == 0 else (True, False):
            competitor = None
            if busy:
                competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=_env("hf"))
                time.sleep(2.0)  # let it reach its steady state
            try:
                order = LOOPS if r % 2 == 0 else tuple(reversed(LOOPS))
                for loop in order:
                    res = run_loop(loop, dtype, steps, hf_dir)
                    res.update(round=r + 1, busy=busy, load=os.getloadavg()[0])
                    rows.append(res)
                    print(
                        f"round {r + 1} {'busy' if busy else 'idle'} {loop:10s} {res['median_s'] * 1e3:8.1f} ms/step "
                        f"(threads {res['threads']}, OMP_WAIT_POLICY {res['omp_wait_policy']}, load {res['load']:.1f})",
                        flush=True,
                    )
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    return rows


def summary(rows: list[dict]) -> dict:
    med = statistics.median
    out = {}
    for loop in LOOPS:
        idle = med(r["median_s"] for r in rows if r["loop"] == loop and not r["busy"])
        busy = med(r["median_s"] for r in rows if r["loop"] == loop and r["busy"])
        out[loop] = {"idle": idle, "busy": busy, "growth": busy / idle}
    return out


def render(rows: list[dict], stats: dict, args: argparse.Namespace, cpu: str) -> str:
    import torch

    params = "25.8M"
    lines = [
        SECTION,
        "",
        f"`bench/busy.py --rounds {args.rounds} --steps {args.steps} --dtype {args.dtype}` "
        f"({time.strftime('%d %b %Y %H:%M', time.gmtime())} UTC). Machine: {cpu}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}. Qwen3-shaped model of {params} parameters, batch {MODEL['batch']} x "
        f"{MODEL['seq_length']}, compute in {args.dtype}. Each loop is a fresh process per run with the "
        "environment a user would have: lmforge with the defaults its command sets (OMP_WAIT_POLICY=PASSIVE, "
        "one share of the cores, its allocator settings), the HF loop with torch's defaults and once more "
        "with OMP_WAIT_POLICY=PASSIVE. Busy: one competing process training an MLP with torch's defaults "
        "(2 threads). Median step of each run (two warm-up steps first), median over runs.",
        "",
        "| loop | idle ms/step | busy ms/step | growth (busy / idle) | lmforge speed / this loop's, idle | busy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lf = stats["lmforge"]
    for loop in LOOPS:
        s = stats[loop]
        lines.append(
            f"| {loop} | {s['idle'] * 1e3:.1f} | {s['busy'] * 1e3:.1f} | {s['growth']:.2f}x | "
            f"{s['idle'] / lf['idle']:.2f}x | {s['busy'] / lf['busy']:.2f}x |"
        )
    verdict = all(stats["lmforge"]["growth"] <= stats[p]["growth"] for p in ("hf", "hf-passive"))
    lines += [
        "",
        "Target (issue 35): lmforge's step time grows no more than the HF loop's: "
        + ("**met** against both HF variants." if verdict else "**missed** against at least one HF variant."),
        "",
        "Why the loops differ: with torch's defaults, OpenMP worker threads spin while they wait for work, so"
        " on a machine with another CPU-bound process they burn the time slices the competitor needs and wait"
        " behind it in turn; lmforge's command sets OMP_WAIT_POLICY=PASSIVE before torch loads"
        " (src/lmforge/cli/threads.py), so its threads sleep instead. The HF loop given the same setting grows"
        " about as much as lmforge: what remains between those two is the step itself.",
        "",
        "All runs (ms/step):",
        "",
        "| round | machine | loop | ms/step | load average |",
        "|---:|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['round']} | {'busy' if r['busy'] else 'idle'} | {r['loop']} | {r['median_s'] * 1e3:.1f} | {r['load']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--worker", choices=LOOPS)
    p.add_argument("--hf-dir", type=Path)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dtype, args.steps, args.hf_dir)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        export_hf(args.dtype, hf_dir)
        rows = measure(args.rounds, args.steps, args.dtype, hf_dir)
    stats = summary(rows)
    body = render(rows, stats, args, cpu_name())
    print(body)
    if not args.no_write:
        from benchdoc import write_section

        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
