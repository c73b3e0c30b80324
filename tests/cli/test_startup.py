"""The cheap commands start without the heavy libraries: `lmforge --help`, `--version` and
`<command> --help` must not import torch (seconds of start-up) nor any optional extra.

Measured as the set of modules a fresh interpreter holds after the command, not as wall time (which
depends on the machine and its load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
HEAVY = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "matplotlib",
    "tensorboard",
    "wandb",
    "mlflow",
    "peft",
)

PROBE = """
import contextlib, io, json, sys
from lmforge.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:  # argparse's --help / --version
        status = exc.code
print(json.dumps({"status": status, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _run(*argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [("--help",), ("--version",), ("check", "--help"), ("train", "--help"), ("eval", "--help")],
    ids=lambda a: " ".join(a),
)
def test_cheap_commands_import_no_heavy_library(argv):
    result = _run(*argv)
    assert result["status"] == 0
    assert result["out"].strip(), "the command printed nothing"
    loaded = {m.split(".")[0] for m in result["modules"]}
    assert not loaded & set(HEAVY), f"`lmforge {' '.join(argv)}` imported {sorted(loaded & set(HEAVY))}"


@pytest.mark.slow
def test_the_probe_sees_torch_when_a_command_needs_it():
    # The measurement itself can fail: `check` with a config types the data section, which imports
    # the data package and torch, and the probe must see that.
    result = _run("check", "--config", str(SRC.parent / "configs" / "demo.yaml"))
    assert "torch" in {m.split(".")[0] for m in result["modules"]}
