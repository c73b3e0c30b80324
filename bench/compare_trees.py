"""Training throughput of two source trees side by side: ``bench/train.py`` of each, alternating.

    .venv/bin/python bench/compare_trees.py --tree main=/tmp/main-snapshot --tree branch=. \\
        [--models demo,100m] [--runs 3] [--steps 3] [--rounds 2]

Each run is one ``bench/train.py --only throughput --no-write`` process of one tree (its own ``src`` on
PYTHONPATH, ``--preload`` modules imported first in both), which times lmforge against the Hugging Face
loop in the same process; the ratio of the
two is what is compared, since the machine may be shared. The trees take turns (A B, then B A, ...)
so that load drifts hit both alike; the load average is recorded before every run. Prints a markdown
table and, per tree and model, the median ratio and its spread.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

LINE = re.compile(
    r"^(?P<model>\S+): lmforge (?P<lf>[\d,]+) tok/s .*HF (?P<hf>[\d,]+) tok/s .*ratio (?P<ratio>[\d.]+)x",
    re.M,
)


def run_tree(root: Path, models: str, steps: int, rounds: int, preload: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_WAIT_POLICY="PASSIVE")
    args = [
        "--models",
        models,
        "--only",
        "throughput",
        "--no-write",
        "--steps",
        str(steps),
        "--rounds",
        str(rounds),
    ]
    # The same modules imported first in both trees, so that import side effects (which moved the HF
    # loop's own speed by up to ~25% between trees in one session) hit both alike.
    code = (
        "import importlib, runpy, sys\n"
        f"for m in {preload.split(',') if preload else []!r}: importlib.import_module(m)\n"
        f"sys.argv = ['train.py', *{args!r}]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, cwd=root / "bench", env=env, capture_output=True, text=True, check=True).stdout
    return [
        {
            "model": m["model"],
            "lf": float(m["lf"].replace(",", "")),
            "hf": float(m["hf"].replace(",", "")),
            "ratio": float(m["ratio"]),
        }
        for m in LINE.finditer(out)
    ]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH of a repository root (twice)")
    p.add_argument("--models", default="demo,100m")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--preload",
        default="lmforge.train.builder,lmforge.train.checkpoint",
        help="modules imported before bench/train.py in both trees (comma-separated; '' for none)",
    )
    args = p.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree]
    rows = []
    for i in range(args.runs):
        order = trees if i % 2 == 0 else trees[::-1]
        for name, root in order:
            load = os.getloadavg()[0]
            for r in run_tree(root, args.models, args.steps, args.rounds, args.preload):
                rows.append({"run": i + 1, "tree": name, "load": load, **r})
                print(
                    f"run {i + 1} {name:>8} {r['model']:>5}: lmforge {r['lf']:,.0f} tok/s, HF {r['hf']:,.0f} tok/s, "
                    f"ratio {r['ratio']:.2f}x (load {load:.1f})",
                    flush=True,
                )
    print("\n| run | tree | model | lmforge tokens/s | HF loop tokens/s | ratio | load average |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['run']} | {r['tree']} | {r['model']} | {r['lf']:,.0f} | {r['hf']:,.0f} | {r['ratio']:.2f}x | {r['load']:.1f} |"
        )
    print()
    for model in dict.fromkeys(r["model"] for r in rows):
        for name, _ in trees:
            ratios = [r["ratio"] for r in rows if r["tree"] == name and r["model"] == model]
            print(
                f"{model} {name}: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
