"""Time to a configuration error: the pre-build validation against building the model first.

Before issue 13, `lmforge train` built the model (and logged it) before a misspelled lr_scheduler key
was refused; now `load_config` + the run plan refuse it first. This measures, on the shipped
configs, the pre-build validation of a valid file (what every run now pays up front) and the model
construction it precedes (the least a typo used to cost before it was reported), in one process,
side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchdoc import write_section
from lmforge.config import load_config
from lmforge.models.build import build_from_config
from lmforge.train.preflight import preflight

SECTION = "## Pre-build validation"
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("configs/demo.yaml", "configs/pretrain_adamw.yaml")


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(path: str, repeats: int) -> tuple[str, float, float]:
    def validate():
        return preflight(load_config(ROOT / path), 1)

    plan = validate()  # warm: imports and first-use caches are not what a run pays per file
    pre = _median_seconds(validate, repeats)
    build = _median_seconds(lambda: build_from_config(plan.model_config, plan.model_class, "cpu"), repeats)
    return path, pre, build


def render(rows: list[tuple[str, float, float]], repeats: int) -> str:
    load = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"`bench/config.py`, median of {repeats}, one process, CPU; load average {load:.1f} at the start.",
        "Pre-build validation is `load_config` + `preflight` (run plan and callbacks) of a valid file; the",
        "peer is building the model it describes on the CPU (initialised weights), which `lmforge train`",
        "used to do before refusing a misspelled `lr_scheduler` key.",
        "",
        "| config | pre-build validation | model construction (peer) | validation / peer |",
        "|---|---|---|---|",
    ]
    for path, pre, build in rows:
        lines.append(f"| `{path}` | {pre * 1e3:.1f} ms | {build * 1e3:.1f} ms | {pre / build:.3f} |")
    lines += [
        "",
        "A configuration error is now reported after the validation alone; a valid run pays it once",
        "before building (it does not replace any later work: the model is still built once).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    rows = [bench(path, args.repeats) for path in CONFIGS]
    text = render(rows, args.repeats)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
