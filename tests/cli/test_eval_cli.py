"""``lmforge eval --checkpoint DIR --config FILE`` on a saved checkpoint and a Megatron dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from lmforge.cli import main
from lmforge.config import load_config, validate_section
from lmforge.data import IndexedDatasetWriter
from lmforge.models import build_model
from lmforge.train.callbacks.validation import build_eval_loader
from lmforge.train.checkpoint import Checkpointable, CheckpointManager
from lmforge.train.state import TrainState
from tiny_fp32 import TINY_RUN_MODEL
from tiny_train_config import megatron_train_dataset

MODEL = {**TINY_RUN_MODEL, "seq_length": 16, "compute_dtype": "float32"}


def _write_data(prefix):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(40):
            writer.add_document([int(t) for t in rng.integers(1, 64, size=int(rng.integers(5, 30)))] + [0])


def _config(tmp_path):
    prefix = tmp_path / "docs"
    _write_data(prefix)
    raw = {
        "output_dir": str(tmp_path / "run"),
        "training": {"steps": 1, "local_batch_size": 2, "global_batch_size": 2},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1.0e-4, "warmup_steps": 0},
        "model": MODEL,
        "train_dataset": megatron_train_dataset(
            prefix, seq_length=16, split="50,50,0", cache=tmp_path / "cache", workers=1
        ),
        "eval_steps": 3,
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _reference(model, loader, batches):
    total, tokens = 0.0, 0.0
    with torch.no_grad():
        for i, b in enumerate(loader):
            if i == batches:
                break
            logits = model(b["input_ids"], position_ids=b.get("position_ids")).logits
            ce = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), reduction="none")
            mask = b["loss_mask"].flatten().float()
            total += float((ce * mask).sum())
            tokens += float(mask.sum())
    return total / tokens


def test_eval_cli_reports_the_checkpoint_loss(tmp_path, capsys):
    config_path = _config(tmp_path)
    torch.manual_seed(1)
    model = build_model(validate_section("model", MODEL))
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True)
    manager.save(Checkpointable(model, state=TrainState(max_steps=1)), 1)
    manager.close()

    expected = _reference(model, build_eval_loader(load_config(config_path)), 3)
    torch.manual_seed(2)  # the CLI builds a differently initialised model: only loading gives `expected`
    status = main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--config", str(config_path), "--json"])
    assert status == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert out["batches"] == 3
    assert out["val_ppl"] == pytest.approx(np.exp(expected), rel=1e-5)

    no_split = ["--set", "train_dataset.dataloader.config.split='100,0,0'"]
    assert (
        main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--config", str(config_path), *no_split]) == 2
    )
    assert "has none" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing"), "--config", str(config_path)]) == 2
    assert "No checkpoint found" in capsys.readouterr().err


def _trained_checkpoint(tmp_path, name, **sections):
    """`lmforge train` for 2 steps of the test config (plus ``sections``); the save_path it wrote."""
    raw = yaml.safe_load(_config(tmp_path).read_text())
    save = tmp_path / name
    raw.update(
        output_dir=str(tmp_path / f"{name}_run"),
        training={**raw["training"], "steps": 2},
        checkpoint={"enable_save": True, "save_path": str(save), "save_interleaved_steps": 2},
        **sections,
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(path)]) == 0
    return save, path


def _eval_json(capsys, *args):
    capsys.readouterr()
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("lora", [False, True], ids=["pretraining", "lora"])
def test_eval_uses_the_checkpoints_own_config(tmp_path, capsys, lora):
    """No --config: the config.yaml saved with the checkpoint gives the model (and LoRA) and the data;
    the result is the one --config gives; --config and --set still override it."""
    extra = (
        {"lora_config": {"target_modules": ".*linear_qkv", "lora_rank": 4, "lora_alpha": 8}} if lora else {}
    )
    save, path = _trained_checkpoint(tmp_path, "lora" if lora else "pre", **extra)
    own = _eval_json(capsys, "--checkpoint", str(save))
    given = _eval_json(capsys, "--checkpoint", str(save), "--config", str(path))
    assert own["val_loss"] == given["val_loss"] and own["batches"] == given["batches"] == 3
    assert _eval_json(capsys, "--checkpoint", str(save), "--set", "eval_steps=1")["batches"] == 1
    other = yaml.safe_load(path.read_text())
    other["eval_steps"] = 2
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert (
        _eval_json(capsys, "--checkpoint", str(save), "--config", str(tmp_path / "other.yaml"))["batches"]
        == 2
    )


def test_eval_without_config_of_a_checkpoint_without_one(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True)
    manager.save(
        Checkpointable(build_model(validate_section("model", MODEL)), state=TrainState(max_steps=1)), 1
    )
    manager.close()
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "has no config.yaml" in err and "--config FILE" in err


@pytest.mark.slow
def test_eval_tasks_on_a_lora_checkpoint_loads_its_adapters(tmp_path, capsys):
    """--tasks without --config on a LoRA run: the run's config.yaml gives lora_config, so the adapters
    are loaded with the base (a base-only model could not take the checkpoint's adapter tensors)."""
    pytest.importorskip("lm_eval")
    from tokenizers import Tokenizer, models, pre_tokenizers

    extra = {"lora_config": {"target_modules": ".*linear_qkv", "lora_rank": 4, "lora_alpha": 8}}
    save, _ = _trained_checkpoint(tmp_path, "lora", **extra)
    words = ["<|endoftext|>", "<unk>", *(f"w{i}" for i in range(20))]  # ids below the model's vocab 64
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    rows = [
        {"context": f"w{i} w{i + 1}", "choices": [f"w{i + 2}", f"w{i + 5}"], "answer": 0} for i in range(4)
    ]
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "--checkpoint", str(save), "--tasks", str(tmp_path / "task.jsonl")]
    assert main([*args, "--tokenizer", str(tmp_path / "tok"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= record["results"]["lmforge_task"]["acc,none"] <= 1.0


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--limit", "5"], "--limit only applies to downstream tasks"),
        (
            ["--tokenizer", "tok.json", "--output", "r.json"],
            "--tokenizer, --output only apply to downstream tasks",
        ),
        (["--batch-size", "4"], "--batch-size only applies"),
        (["--num-fewshot", "2"], "--num-fewshot only applies"),
        (
            ["--tasks", "t.jsonl", "--eval-steps", "3"],
            "with --tasks, limit the items per task with --limit N",
        ),
    ],
)
def test_a_flag_of_the_other_mode_is_refused_not_ignored(tmp_path, capsys, flags, needle):
    # Before: the harness flags were silently ignored by the validation-loss mode (exit 0, a loss printed)
    # and --eval-steps by --tasks.
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def _model_only_checkpoint(tmp_path):
    """A checkpoint whose config.yaml holds only the model section (as `convert --from-hf` writes)."""
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True)
    manager.save(
        Checkpointable(build_model(validate_section("model", MODEL)), state=TrainState(max_steps=1)), 1
    )
    manager.close()
    iteration = next((tmp_path / "ckpt").glob("iteration_*"))
    (iteration / "config.yaml").write_text(yaml.safe_dump({"model": MODEL}))
    return tmp_path / "ckpt"


def test_tasks_refuse_a_device_and_a_set_they_cannot_use(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from lmforge.utils.logging import setup_logging

    setup_logging()  # log to this test's capture, not to a stream an earlier test closed
    ckpt = _model_only_checkpoint(tmp_path)
    (tmp_path / "t.jsonl").write_text(json.dumps({"context": "a", "choices": ["b", "c"], "answer": 0}) + "\n")
    args = ["eval", "--checkpoint", str(ckpt), "--tasks", str(tmp_path / "t.jsonl")]
    # Before: torch's RuntimeError traceback listing its device types.
    assert main([*args, "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--device 'tpu' is not a device lmforge runs on" in err and "Traceback" not in err, err
    # Before: the --set was dropped without a word (the config.yaml read as model-only, exit 0).
    assert main([*args, "--device", "cpu", "--set", "training.steps=4"]) == 2
    err = capsys.readouterr().err
    assert "--set:" in err and "is not a full train config" in err and "--config" in err, err


@pytest.mark.slow
def test_tasks_with_another_models_tokenizer(tmp_path, capsys):
    # Before: "IndexError: index out of range in self" from the embedding lookup inside the harness.
    pytest.importorskip("lm_eval")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmforge.utils.logging import setup_logging

    setup_logging()
    ckpt = _model_only_checkpoint(tmp_path)
    vocab = {**{f"w{i}": i for i in range(100)}, "<|endoftext|>": 100}  # past the model's 64 ids
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.jsonl").write_text(
        json.dumps({"context": "w1 w80", "choices": ["w3", "w9"], "answer": 0}) + "\n"
    )
    args = ["eval", "--checkpoint", str(ckpt), "--tasks", str(tmp_path / "t.jsonl"), "--device", "cpu"]
    assert (
        main([*args, "--tokenizer", str(tmp_path / "tokenizer.json"), "--output", str(tmp_path / "r.json")])
        == 2
    )
    err = capsys.readouterr().err
    assert "to token id 80, but the model has 64 token ids" in err and "Traceback" not in err, err
