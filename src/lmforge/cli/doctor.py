"""``lmforge doctor RUN_DIR [--json]``: diagnose a run from what it wrote.

Reads the run directory's metrics.jsonl, train.log, config.yaml, doctor_facts.json, monitor files and
its latest checkpoint's common.json, applies the rules of :mod:`lmforge.tools.doctor.rules` and
prints each finding (symptom, evidence, likely cause, YAML keys to change) or "no problem found" with
the healthy signs it checked. ``--json`` prints
``{"findings": [{"symptom", "evidence", "cause", "keys"}], "checked": [...]}`` (an empty
``findings`` list means healthy). The exit status is 0 (1 when the run never completed a step, 2 for an
unreadable run dir).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="diagnose a training run from its output directory",
        description=(
            "Diagnose a run: reads RUN_DIR/metrics.jsonl, train.log, config.yaml, doctor_facts.json, monitor/ "
            "and the latest checkpoint's metadata; prints each problem found with its evidence, likely cause "
            "and the YAML keys to change, or the healthy signs checked. Exit 0; 1 when the run never completed "
            "a step; 2 when RUN_DIR holds no run."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.set_defaults(func=run)


def _value(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, float) else f"{v:g}"


def format_report(diagnosis: Any, run_dir: str) -> str:
    lines = [f"lmforge doctor: {run_dir}"]
    if not diagnosis.findings:
        lines.append("no problem found. Healthy signs checked:")
        lines += [f"  - {c}" for c in diagnosis.checked]
        return "\n".join(lines)
    for i, f in enumerate(diagnosis.findings, 1):
        lines.append(f"{i}. {f.symptom}")
        lines.append(f"   evidence: {f.evidence}")
        lines.append(f"   likely cause: {f.cause}")
        if f.keys:
            lines.append("   change:")
            lines += [f"     {k}: {_value(v)}" for k, v in f.keys.items()]
        else:
            lines.append("   change: no YAML key governs this (see the cause)")
    lines.append("Healthy signs checked:")
    lines += [f"  - {c}" for c in diagnosis.checked]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from lmforge.tools.doctor import diagnose, read_run_dir

    diagnosis = diagnose(read_run_dir(args.run_dir))
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        print(format_report(diagnosis, args.run_dir))
    # A run that never trained is never "healthy": exit 1 (findings about a run that trained: 0).
    return 1 if any(f.fatal for f in diagnosis.findings) else 0
