"""Step time and page faults under glibc's default allocator behaviour and under lmforge's (``utils/malloc.py``).

    PYTHONPATH=src .venv/bin/python bench/allocator.py [--models 100m] [--steps 3] [--rounds 2] [--no-write]

For each setting a fresh process (the allocator is per process) builds both loops of ``bench/train.py``
(lmforge's trainer build and step; the Hugging Face loop with fused AdamW), runs one warm-up step each,
then alternates rounds of timed steps and records, per step, the wall time and the minor page faults
(``getrusage``). ``default`` runs with ``LMFORGE_MALLOC=default`` (glibc's own: large freed blocks unmapped,
the heap trimmed); ``lmforge`` with the defaults the ``lmforge`` command applies. Writes the "## Allocator"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchdoc import replace_section

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"

CHILD = r"""
import json, resource, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, {bench!r})
from lmforge.utils import malloc
malloc.apply_malloc_defaults()
import torch
import train as B

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

out = {{"status": malloc.status, "models": {{}}}}
for name in {models!r}:
    sec = B.MODELS[name]
    b, s = sec["batch"], sec["seq_length"]
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, sec["vocab_size"], (b, s + 1), generator=g)
    batch = {{"input_ids": full[:, :-1], "labels": full[:, 1:].clone(), "full": full[:, :-1]}}
    model, _, lf = B.lmforge_runner(sec, {{k: v for k, v in batch.items() if k != "full"}})
    _, hf = B.hf_runner(model, batch, Path(tempfile.mkdtemp()))
    lf(), hf()
    rec = {{"lmforge": [], "hf": []}}
    for _ in range({rounds}):
        for key, fn in (("lmforge", lf), ("hf", hf)):
            for _ in range({steps}):
                f0, t0 = faults(), time.perf_counter()
                fn()
                rec[key].append((time.perf_counter() - t0, faults() - f0))
    out["models"][name] = {{"tokens": b * s, **rec}}
print("RESULT " + json.dumps(out))
"""


def run(setting: str, models: list[str], steps: int, rounds: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    for k in [k for k in env if k.startswith("MALLOC_") or k == "LMFORGE_MALLOC"]:
        del env[k]
    if setting == "default":
        env["LMFORGE_MALLOC"] = "default"
    code = CHILD.format(bench=str(REPO / "bench"), models=models, steps=steps, rounds=rounds)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO / "bench", env=env, capture_output=True, text=True, check=True
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="100m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    models = [m for m in args.models.split(",") if m]
    load = os.getloadavg()[0]
    rows = []
    for setting in ("default", "lmforge"):
        res = run(setting, models, args.steps, args.rounds)
        for name, rec in res["models"].items():
            for loop in ("lmforge", "hf"):
                times = [t for t, _ in rec[loop]]
                flt = [f for _, f in rec[loop]]
                row = {
                    "setting": setting,
                    "model": name,
                    "loop": "lmforge" if loop == "lmforge" else "HF loop",
                    "ms": 1e3 * statistics.median(times),
                    "tps": rec["tokens"] / statistics.median(times),
                    "faults": statistics.median(flt),
                }
                rows.append(row)
                print(
                    f"{setting:8s} {name:5s} {row['loop']:8s} {row['ms']:7.0f} ms/step "
                    f"{row['tps']:7.0f} tok/s {row['faults']:9.0f} minor faults/step",
                    flush=True,
                )
    if not args.no_write:
        lines = [
            "## Allocator",
            "",
            f"`bench/allocator.py` (load average at start {load:.1f}). Each setting is a fresh process timing "
            "lmforge's trainer step and the HF loop (fused AdamW) alternately: median over "
            f"{args.rounds} x {args.steps} steps after a warm-up step; minor page faults per step from "
            "`getrusage`. `default`: `LMFORGE_MALLOC=default` (glibc unmaps large freed blocks and trims "
            "the heap); `lmforge`: what the `lmforge` command sets (`utils/malloc.py`: `M_MMAP_MAX=0`, "
            "`M_TRIM_THRESHOLD` max).",
            "",
            "| allocator | model | loop | ms/step | tokens/s | minor faults/step |",
            "|---|---|---|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['setting']} | {r['model']} | {r['loop']} | {r['ms']:,.0f} | {r['tps']:,.0f} | "
                f"{r['faults']:,.0f} |"
            )
        text = DOC.read_text()
        DOC.write_text(replace_section(text, "## Allocator", "\n".join(lines) + "\n"))
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
