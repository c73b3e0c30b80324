"""The export read by transformers 4.57 (the last 4.x), in a second environment: same logits, same
rope base (4.x reads ``rope_theta``, not 5.x's ``rope_parameters``), same tokenizer ids.

The environment is a venv at ``$LMFORGE_TF4_VENV`` (default ``~/.cache/lmforge/test-venvs/
transformers-4.57``), created on first use: a ``.pth`` file puts this interpreter's site-packages
(torch, numpy, ...) behind it and pip installs ``transformers==4.57.*`` (with its own tokenizers and
huggingface_hub) into it, ~25 s and ~140 MB once. Delete the directory to rebuild it. Without PyPI
the test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.models import build_model, save_model_checkpoint

pytestmark = pytest.mark.slow

VENV = Path(os.environ.get("LMFORGE_TF4_VENV", Path.home() / ".cache/lmforge/test-venvs/transformers-4.57"))
READY = VENV / ".lmforge-ready"

SCRIPT = r"""
import json, sys, torch, transformers
texts = json.loads(sys.argv[1])
results = []
for out in sys.argv[2:]:  # one interpreter for every directory: importing transformers is the slow part
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.load(out + "/ids.pt")
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, out + "/logits_tf4.pt")
    results.append({
        "version": transformers.__version__,
        "rope_theta": model.config.rope_theta,
        "rope_scaling": model.config.rope_scaling,
        "ids": [tok(t)["input_ids"] for t in texts],
        "eos": tok.eos_token_id,
    })
print(json.dumps(results))
"""


def _venv_python() -> Path:
    python = VENV / "bin" / "python"
    if READY.is_file():
        return python
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(VENV)], check=True, timeout=120)
        purelib = Path(
            subprocess.check_output(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
            ).strip()
        )
        (purelib / "lmforge_parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "transformers==4.57.*"],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot create the transformers 4.57 test venv at {VENV}: {exc}")
    if done.returncode != 0:
        pytest.skip(
            f"pip could not install transformers==4.57.* into {VENV} (offline?): {done.stderr[-400:]}"
        )
    READY.touch()
    return python


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "llama": {"rope_theta": 1.0e6, "rope_scaling": LLAMA3},
    "qwen3": {"rope_theta": 5.0e5},
}


def test_export_reads_the_same_in_transformers_4_57(tmp_path, tokenizer_dir, tiny_section, sample_text):
    python = _venv_python()
    models, dirs = {}, []
    for model_type, rope in CASES.items():
        torch.manual_seed(0)
        models[model_type] = build_model(validate_section("model", tiny_section(model_type, **rope)))
        save_model_checkpoint(models[model_type], tmp_path / model_type / "ckpt")
        out = tmp_path / model_type / "hf"
        args = ["convert", "--from", str(tmp_path / model_type / "ckpt"), "--to-hf", str(out)]
        assert main([*args, "--tokenizer", str(tokenizer_dir), "--max-shard-size", "40KB"]) == 0
        torch.save(torch.randint(0, 300, (2, 48)), out / "ids.pt")
        dirs.append(str(out))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # transformers 4.57 from the venv
    done = subprocess.run(
        [str(python), "-c", SCRIPT, json.dumps(sample_text), *dirs],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (model_type, rope), got, out in zip(CASES.items(), results, dirs):
        assert got["version"].startswith("4.57.")
        assert got["rope_theta"] == rope["rope_theta"], model_type
        assert (got["rope_scaling"] or {}).get("rope_type") == rope.get("rope_scaling", {}).get("rope_type")
        ids = torch.load(Path(out) / "ids.pt")
        with torch.no_grad():
            ours = models[model_type](ids).logits
        assert (ours - torch.load(Path(out) / "logits_tf4.pt")).abs().max() <= 1e-4, model_type
        assert got["ids"] == [tok.encode(t).ids for t in sample_text]
        assert got["eos"] == tok.token_to_id("<|endoftext|>")
