"""`lmforge eval --checkpoint DIR` on SFT and LoRA checkpoints, with no --config: the checkpoint's own
config.yaml gives the model, the adapters and the SFT validation data; --config still overrides it.

The reference is the run itself: the validation loss the training run logged at the step it saved,
on the same held-out conversations with the same weights, computed by the trainer's validation
callback (not by the eval command's code path)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from cli.test_sft_validation import _config  # noqa: E402
from lmforge.cli import main  # noqa: E402

TOLERANCE = 1e-5  # float32 compute: the same forward in two processes, summed in another order


def _lmforge(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "lmforge", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )


def _train_and_evaluate(tmp_path: Path, raw: dict, capsys) -> None:
    raw["training"]["steps"] = 2
    raw["eval_interval"] = 2
    raw["checkpoint"]["save_interleaved_steps"] = 2
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw))
    assert (
        main(["train", "--config", str(tmp_path / "train.yaml")]) == 0
    )  # in this process: one start-up less
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    at_save = next(r for r in logged if r.get("step") == 2 and "val_loss" in r)

    ckpt = str(tmp_path / "ckpt")
    own = _lmforge(tmp_path, "eval", "--checkpoint", ckpt, "--json")  # no --config
    assert own.returncode == 0, own.stderr[-3000:]
    assert own.stderr.strip() == "", own.stderr  # the run's own config.yaml reads back without a note
    result = json.loads(own.stdout.strip().splitlines()[-1])
    assert math.isfinite(result["val_loss"]) and math.isfinite(result["val_ppl"])
    assert result["val_tokens"] == at_save["val_tokens"]  # the same held-out conversations
    assert abs(result["val_loss"] - at_save["val_loss"]) <= TOLERANCE * max(1.0, abs(at_save["val_loss"]))

    # --config overrides the checkpoint's config (the same command, in this process): a larger
    # held-out share is another validation set.
    other = {**raw, "train_dataset": json.loads(json.dumps(raw["train_dataset"]))}
    other["train_dataset"]["dataloader"]["validation_split"] = 0.5
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", ckpt, "--config", str(tmp_path / "other.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_tokens"] > result["val_tokens"]


@pytest.mark.slow
def test_eval_an_sft_checkpoint_with_its_own_config(tmp_path, capsys):
    _train_and_evaluate(tmp_path, _config(tmp_path, validation_split=0.1), capsys)


@pytest.mark.slow
def test_eval_a_lora_checkpoint_with_its_own_config(tmp_path, capsys):
    raw = _config(tmp_path, validation_split=0.1)
    raw["lora_config"] = {"target_modules": ".*linear_qkv|.*linear_fc1", "lora_rank": 4, "lora_alpha": 8}
    _train_and_evaluate(tmp_path, raw, capsys)
