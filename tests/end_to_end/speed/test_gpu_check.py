"""bench/gpu_check.sh's CPU dry run: the GPU check script must keep running (tiny sizes, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert report["dry_run"] is True
    expected = {
        "train_eager",
        "train_compile",
        "train_float8",
        "attention",
        "grouped_mm",
        "swap",
        "profiler",
        "optimizers",
    }
    assert set(checks) == expected
    assert all(c["status"] in ("ok", "skipped") for c in checks.values()), checks
    train = checks["train_eager"]
    assert train["tokens_per_s"] > 0 and "measured" in train["mfu_denominator"]
    # The dry run computes in this CPU's native dtype (float32 where bf16 is emulated).
    from lmforge.utils.native_dtype import choose_compute_dtype

    native = str(choose_compute_dtype("auto", "cpu").dtype).removeprefix("torch.")
    assert train["compute_dtype"] == native and f"computes in {native}" in train["mfu_denominator"]
    if "torchao" in sys.modules or _has_torchao():
        assert checks["train_float8"]["status"] == "ok"
    assert checks["attention"]["segments_vs_dense_max_abs"] < 1e-5
    assert checks["optimizers"]["adamw_vs_torch_fused"] > 0


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None
