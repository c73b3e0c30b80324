"""SFT validation like the Hugging Face Trainer: a validation set for TextDataLoader data (a held-out
share of the training files, or its own files through eval_dataset, which inherits the training
loader's preprocessing), the best checkpoint by validation loss, and `check` refusing what `train`
would fail on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.config import dump_yaml, load_config
from lmforge.errors import ConfigError
from lmforge.train.callbacks.validation import build_eval_loader

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from data.text_helpers import WORDS, token_id, write_jsonl, write_tokenizer  # noqa: E402


def _config(tmp_path: Path, **loader) -> dict:
    tok = write_tokenizer(tmp_path / "tok")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"hi {WORDS[i % 40]}"},
                {"role": "assistant", "content": f"{WORDS[(3 * i) % 40]} be kind"},
            ]
        }
        for i in range(120)
    ]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    return {
        "output_dir": str(tmp_path / "run"),
        "training": {"steps": 6, "local_batch_size": 2, "global_batch_size": 2, "seed": 1},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 3.0e-3, "warmup_steps": 1},
        "checkpoint": {"save_path": str(tmp_path / "ckpt"), "save_interleaved_steps": 2, "save_max": 1},
        "train_dataset": {
            "dataloader": {
                "type": "TextDataLoader",
                "data_path": [str(tmp_path / "chat.jsonl")],
                "tokenizer": tok,
                "chat_template": "chatml",
                "pack": "whole",
                "seq_length": 32,
                "column_names": ["input_ids", "labels", "loss_mask", "position_ids", "actual_seq_len"],
                **loader,
            },
            "num_parallel_workers": 0,
        },
        "model": {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "intermediate_size": 64,
            "vocab_size": 64,
            "seq_length": 32,
            "compute_dtype": "float32",
        },
    }


def _lmforge(tmp_path: Path, command: str, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "lmforge", command, "--config", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )


def _train_on_a_terminal(tmp_path: Path, config: dict) -> tuple[int, str]:
    """`lmforge train` with its standard error on a pseudo-terminal, as a person runs it."""
    import fcntl
    import pty
    import struct
    import termios

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "120"}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a fresh pty is 0x0
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "train", "--config", str(path)],
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=tmp_path,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=600), b"".join(chunks).decode(errors="replace")


def test_held_out_documents_are_never_trained_on(tmp_path):
    from lmforge.config import validate_section
    from lmforge.data import build_dataloader

    tok = write_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "docs.jsonl", [{"text": w} for w in WORDS[:40]])  # one distinct token each
    loader = {
        "type": "TextDataLoader",
        "data_path": [str(tmp_path / "docs.jsonl")],
        "tokenizer": tok,
        "seq_length": 8,
    }
    section = validate_section(
        "train_dataset", {"dataloader": {**loader, "validation_split": 0.25}, "num_parallel_workers": 0}
    )
    train = build_dataloader(section, local_batch_size=4, seq_length=8)
    # A row's last token is a label only: both columns together hold every token of the rows.
    seen = {
        int(t)
        for _ in range(30)
        for b in [next(train)]
        for c in ("input_ids", "labels")
        for t in b[c].flatten()
    }
    valid = build_dataloader(section, local_batch_size=4, seq_length=8, phase="valid")
    held = {int(t) for b in valid for c in ("input_ids", "labels") for t in b[c].flatten()}
    words = {token_id(w) for w in WORDS[:40]}
    assert held & words and seen & words
    assert not (held & seen & words), "a held-out document was trained on"
    assert (held | seen) & words == words
    assert 6 <= len(held & words) <= 14  # about a quarter of 40


def test_validation_batches_are_the_same_count_on_every_rank(tmp_path):
    cfg = load_config(_config(tmp_path, validation_split=0.1))
    lengths = [len(list(build_eval_loader(cfg, dp_rank=r, dp_size=3))) for r in range(3)]
    assert len(set(lengths)) == 1
    tokens = sum(
        float(b["loss_mask"].sum()) for r in range(3) for b in build_eval_loader(cfg, dp_rank=r, dp_size=3)
    )
    single = sum(float(b["loss_mask"].sum()) for b in build_eval_loader(cfg))
    assert tokens == single > 0  # the padding rows add no loss tokens


def test_eval_dataset_inherits_the_training_loaders_preprocessing(tmp_path):
    raw = _config(tmp_path)
    write_jsonl(
        tmp_path / "val.jsonl",
        [{"messages": [{"role": "user", "content": "hi w1"}, {"role": "assistant", "content": "w2"}]}] * 5,
    )
    raw["eval_interval"] = 2
    raw["eval_dataset"] = {"dataloader": {"data_path": [str(tmp_path / "val.jsonl")]}}
    cfg = load_config(raw)
    typed = cfg.eval_dataset.dataloader.typed
    for key in ("tokenizer", "chat_template", "seq_length", "pack", "column_names"):
        assert getattr(typed, key) == raw["train_dataset"]["dataloader"][key], key
    batches = list(build_eval_loader(cfg))
    ids = torch.cat([b["input_ids"] for b in batches]).flatten().tolist()
    assert token_id("<|im_start|>") in ids  # the chat template was applied
    # The reference: the training loader's own formatting of one such row (trained tokens per row).
    from lmforge.data.text_format import RowFormatter
    from lmforge.data.text_settings import text_loader_settings
    from lmforge.utils.tokenizer import load_tokenizer

    train = text_loader_settings(cfg.train_dataset.dataloader.typed, seq_length=32)
    row = json.loads((tmp_path / "val.jsonl").read_text().splitlines()[0])
    ((_, _, mask),) = RowFormatter(load_tokenizer(train.tokenizer), train.format).encode_rows([(0, row)], "x")
    assert sum(float(b["loss_mask"].sum()) for b in batches) == 5 * int(mask.sum())
    # The resolved config (as a checkpoint's config.yaml holds it) loads again to the same sections.
    again = load_config(yaml.safe_load(dump_yaml(cfg)))
    assert again.eval_dataset.dataloader.typed == typed
    raw["eval_dataset"]["dataloader"]["seq_length"] = 0
    with pytest.raises(ConfigError, match=r"eval_dataset\.dataloader\.seq_length"):
        load_config(raw)


@pytest.mark.slow
def test_check_refuses_an_eval_interval_without_a_validation_set(tmp_path):
    raw = _config(tmp_path)
    raw["eval_interval"] = 2
    proc = _lmforge(tmp_path, "check", raw)
    assert proc.returncode == 2
    assert "eval_interval = 2" in proc.stderr and "validation_split" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sft_run_validates_and_keeps_the_best_checkpoint(tmp_path):
    raw = _config(tmp_path, validation_split=0.1)
    raw["eval_interval"] = 2
    status, terminal = _train_on_a_terminal(tmp_path, raw)
    assert status == 0, terminal[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(evaluated) == [2, 4, 6]
    best_step = min(evaluated, key=evaluated.get)
    best = json.loads((tmp_path / "run" / "best_validation.json").read_text())
    assert best["step"] == best_step and best["val_loss"] == evaluated[best_step]
    assert Path(best["checkpoint"]).name == f"iteration_{best_step:08d}"
    assert Path(best["checkpoint"]).is_dir()  # kept, although save_max is 1
    assert (tmp_path / "ckpt" / "iteration_00000006").is_dir()
    # (The summary aligns its keys to the longest one: the spaces are layout.)
    assert re.search(
        rf"best validation +: val_loss {evaluated[best_step]:.6f} at step {best_step}\b", terminal
    )
    # Progress a person can read: the epoch, elapsed time and ETA on each line, a live bar, no 0.00T.
    step_lines = [line for line in terminal.splitlines() if "INFO step: [" in line]
    assert len(step_lines) == 6
    assert all(re.search(r"epoch: 1 \| elapsed: \d+:\d\d:\d\d \| eta: \d+:\d\d:\d\d", s) for s in step_lines)
    assert "throughput:   0.00T" not in terminal
    assert re.search(r"training: +100%.*6/6", terminal), terminal[-2000:]


def test_rotation_keeps_the_best_checkpoint(tmp_path):
    from lmforge.train.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpt", save_max=1)
    dirs = [tmp_path / "ckpt" / f"iteration_{s:08d}" for s in (2, 4, 6)]
    for d in dirs:
        d.mkdir()
    manager.keep = dirs[0]
    manager.saved_this_run = list(dirs)
    manager._rotate()
    assert [d.is_dir() for d in dirs] == [True, False, True]


def test_hf_data_loader_holds_out_a_validation_share_too(tmp_path):
    raw = _config(tmp_path)
    loader = raw["train_dataset"]["dataloader"]
    raw["train_dataset"]["dataloader"] = {
        "type": "HFDataLoader",
        "load_func": "load_dataset",
        "path": "json",
        "data_files": loader["data_path"][0],
        "tokenizer": {"tokenizer_file": loader["tokenizer"]},
        "seq_length": 32,
        "validation_split": 0.1,
    }
    raw["eval_interval"] = 2
    batches = list(build_eval_loader(load_config(raw)))
    assert batches and sum(float(b["loss_mask"].sum()) for b in batches) > 0


def test_a_resumed_run_keeps_the_best_of_the_run_it_resumes(tmp_path):
    from types import SimpleNamespace

    from lmforge.train.callbacks.evaluation import BestValidationCallback

    (tmp_path / "best_validation.json").write_text(
        json.dumps({"step": 2, "val_loss": 1.5, "val_ppl": 4.48, "checkpoint": None})
    )
    cb = BestValidationCallback(tmp_path)
    cb.on_train_begin(None, SimpleNamespace(global_step=4))
    cb.on_step_end(None, SimpleNamespace(global_step=6), metrics={"val_loss": 2.0})  # worse
    assert json.loads((tmp_path / "best_validation.json").read_text())["step"] == 2
    cb.on_step_end(None, SimpleNamespace(global_step=8), metrics={"val_loss": 1.0})  # better
    assert json.loads((tmp_path / "best_validation.json").read_text())["step"] == 8
    fresh = BestValidationCallback(tmp_path)  # a fresh start (step 0) begins a new record
    fresh.on_train_begin(None, SimpleNamespace(global_step=0))
    assert fresh.best is None
