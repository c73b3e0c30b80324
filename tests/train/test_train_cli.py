"""``lmforge train`` / ``generate`` / ``checkpoint inspect`` with the real builders on a tiny Qwen3."""

from __future__ import annotations

import pytest
import torch
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import TrainerCallback, read_metrics
from tiny_train_config import tiny_run_config, write_word_tokenizer


def write_config(tmp_path, optimizer: dict, steps: int = 12, **training) -> str:
    """tmp_path/train.yaml of a tiny bf16 run (tests/tiny_train_config.py) with ``optimizer``; returns its path."""
    raw = tiny_run_config(
        tmp_path,
        output_dir=tmp_path / "run",
        training={
            "steps": steps,
            "local_batch_size": 2,
            "global_batch_size": 4,
            "seed": 3,
            "deterministic": True,
            **training,
        },
        optimizer=optimizer,
        lr_scheduler={
            "type": "CosineWithWarmUpLR",
            "learning_rate": 1.0e-2,
            "warmup_steps": 1,
            "lr_end": 1.0e-3,
        },
        checkpoint={"save_path": str(tmp_path / "ckpt"), "save_interleaved_steps": 6, "save_max": 3},
        model={"compute_dtype": "bfloat16"},
        seq_length=16,
        split="90,10,0",
        documents=120,
        tokenizer=True,
    )
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


ADAMW = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.01}
MUON = {"type": "Muon", "momentum": 0.95, "weight_decay": 0.01, "adamw_betas": [0.9, 0.95]}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [ADAMW, MUON], ids=["adamw", "muon"])
def test_train_cli_end_to_end(tmp_path, optimizer, capsys):
    cfg = write_config(tmp_path, optimizer, steps=16)
    assert main(["train", "--config", cfg]) == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 16 and not any(r.get("skipped") for r in records)
    assert sum(r["loss"] for r in records[-3:]) / 3 < sum(r["loss"] for r in records[:3]) / 3 - 0.3
    assert all(r["mfu"] is not None and r["tokens_per_s"] > 0 for r in records)
    assert (tmp_path / "run" / "curves.png").is_file() and (tmp_path / "run" / "summary.json").is_file()
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "iteration_00000016" in out and "global_step=16" in out and "optimizer" in out
    assert (tmp_path / "ckpt" / "iteration_00000016" / "tokenizer.json").is_file()
    argv = [
        "generate",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--prompt",
        "t5 t7 t9",
        "--max-new-tokens",
        "6",
    ]
    assert main([*argv, "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("t5 t7 t9") and len(text.split()) > 3


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, **kw):
        if state.global_step == self.step:
            kw["trainer"].request_stop("test stop")


@pytest.mark.slow
def test_real_stack_resume_is_bitwise_exact(tmp_path):
    """bf16 compute + fp32 parameters (FSDP2) + lmforge AdamW + Megatron loader: 6 straight == 3, stop, resume, 3."""
    straight = tmp_path / "a"
    straight.mkdir()
    cfg = write_config(straight, ADAMW, steps=6)
    # Saving every 2 steps must not disturb training (a save only reads the live state).
    assert main(["train", "--config", cfg, "--set", "checkpoint.save_interleaved_steps=2"]) == 0
    split = tmp_path / "b"
    split.mkdir()
    cfg = write_config(split, ADAMW, steps=6)
    trainer = build_trainer(load_config(cfg, ["checkpoint.save_interleaved_steps=100"]))
    trainer.callbacks.add(StopAt(3))
    trainer.fit()
    assert (split / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert main(["train", "--config", cfg, "--set", f"checkpoint.load_path={split / 'ckpt'}"]) == 0
    a = [
        (r["step"], r["loss"], r["grad_norm"], r["lr"])
        for r in read_metrics(straight / "run" / "metrics.jsonl")
    ]
    b = [
        (r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(split / "run" / "metrics.jsonl")
    ]
    assert len(a) == 6 and a == b


@pytest.mark.slow
def test_fine_tune_from_a_hugging_face_directory(tmp_path):
    """load_path = an HF model directory (no_load_optim: true) starts training from its weights."""
    from lmforge.models import build_model, save_hf_pretrained

    cfg = load_config(write_config(tmp_path, ADAMW, steps=2))
    torch.manual_seed(123)
    source = build_model(cfg.model)
    save_hf_pretrained(source, tmp_path / "hf")
    refused = load_config(write_config(tmp_path, ADAMW, steps=2), [f"checkpoint.load_path={tmp_path / 'hf'}"])
    from lmforge.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not supported for HuggingFace checkpoints"):
        build_trainer(refused).fit()
    cfg = load_config(
        write_config(tmp_path, ADAMW, steps=2),
        [f"checkpoint.load_path={tmp_path / 'hf'}", "checkpoint.no_load_optim=true"],
    )
    trainer = build_trainer(cfg)
    trainer.resumption.resume_or_start()
    ours = dict(trainer.model.named_parameters())
    for name, p in source.named_parameters():
        # fp32 parameters (sharded over the one process) holding the bf16 weights exactly.
        assert torch.equal(ours[name].full_tensor(), p.float()), name
    assert trainer.state.global_step == 0


def test_generate_from_a_hugging_face_directory(tmp_path, capsys):
    from lmforge.models import build_model, save_hf_pretrained

    cfg = load_config(write_config(tmp_path, ADAMW, steps=1))
    torch.manual_seed(5)
    model = build_model(cfg.model)
    save_hf_pretrained(model, tmp_path / "hf")
    write_word_tokenizer(tmp_path / "hf" / "tokenizer.json")
    argv = ["generate", "--checkpoint", str(tmp_path / "hf"), "--prompt", "t3 t4", "--max-new-tokens", "5"]
    assert main([*argv, "--temperature", "0"]) == 0
    out = capsys.readouterr().out.split()
    # Greedy continuation computed here from the same weights (token ids are the word numbers).
    ids = [3, 4]
    model.eval()
    with torch.no_grad():
        for _ in range(5):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].float().argmax())
            if nxt == 0:
                break
            ids.append(nxt)
    assert out == [f"t{i}" for i in ids]
