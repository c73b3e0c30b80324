"""`lmforge eval --tasks arc_easy` without network: one clear line and exit 2, not a traceback after
the download libraries' retries (issue 31, point 10)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import validate_section
from lmforge.models import build_model, save_hf_pretrained

pytest.importorskip("lm_eval")
SRC = str(Path(__file__).resolve().parents[3] / "src")


@pytest.mark.slow
def test_registry_task_offline_is_one_clear_line(tmp_path, tokenizer_dir, tiny_section):
    save_hf_pretrained(
        build_model(validate_section("model", tiny_section("qwen3"))),
        tmp_path / "hf",
        tokenizer=tokenizer_dir,
    )
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing listens there: the Hub is unreachable
        "HF_HOME": str(tmp_path / "hf_home"),  # an empty cache
        "HF_DATASETS_CACHE": str(tmp_path / "hf_home" / "datasets"),
    }
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "lmforge",
        "eval",
        "--checkpoint",
        str(tmp_path / "hf"),
        "--tasks",
        "arc_easy",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "arc_easy" in errors[0] and "http://127.0.0.1:9 cannot be reached (offline)" in errors[0]
    assert "Traceback" not in proc.stderr
