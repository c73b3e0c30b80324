"""Peak memory of a pipeline-parallel training step with the plain and the chunked loss, per rank.

    PYTHONPATH=src python bench/pp_loss_memory.py [--vocab 32768]

Two gloo ranks, PP 2 (1F1B), a 2-layer Qwen3-shaped model (hidden 256, seq 256, fp32), global batch 4
in 2 micro-batches of 2 × 256 tokens, measured by tests/tools/measure_parallel.py (the bytes of all
live tensor storages at every operator of one training step, on each rank; the planner tests'
accounting) with ``model.loss_chunk_size`` 0 (plain: the whole ``[512, vocab]`` fp32 logits), 512 (one
chunk of the whole micro-batch) and 128, beside ``lmforge check``'s estimate. Run it with
``PYTHONPATH`` pointing at another tree's ``src`` to measure that tree (the peers are the plain loss,
and an older tree). Prints a markdown table (recorded in docs/benchmarks.md by hand).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    from planner.measure import config
    from planner.measure_parallel import estimate_parallel, measure_parallel

    cases = {
        f"loss_chunk_size {chunk}": config(
            training__global_batch_size=4, model__vocab_size=args.vocab, model__loss_chunk_size=chunk
        )
        | {"parallelism": {"pipeline_parallel": 2}}
        for chunk in (0, 512, 128)
    }
    peaks = measure_parallel(cases, world=2, timeout=600)
    print(
        f"| loss (vocabulary {args.vocab}) | first stage MiB | last stage MiB | estimate MiB | estimate / max |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, raw in cases.items():
        est = estimate_parallel(raw, 2).total()
        first, last = peaks[name]
        print(
            f"| {name} | {first / MIB:.1f} | {last / MIB:.1f} | {est / MIB:.1f} | {est / max(first, last):.3f} |"
        )


if __name__ == "__main__":
    main()
