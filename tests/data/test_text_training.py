"""The SFT recipe (configs/sft_chat_lora.yaml) end to end on tiny files: HF base → LoRA chat SFT with
TextDataLoader (worker processes) → a checkpoint resumed with bitwise the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import TrainerCallback, read_metrics

from .text_helpers import WORDS, write_jsonl, write_tokenizer

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "sft_chat_lora.yaml"


def _overrides(tmp_path, run: str, steps: int, *extra: str) -> list[str]:
    sets = [
        f"output_dir={tmp_path / run}",
        f"checkpoint.save_path={tmp_path / run / 'ckpt'}",
        f"checkpoint.load_path={tmp_path / 'hf'}",
        "checkpoint.save_interleaved_steps=2",
        f"training.steps={steps}",
        "training.local_batch_size=2",
        "training.global_batch_size=4",
        f"train_dataset.dataloader.data_path=['{tmp_path / 'chat.jsonl'}']",
        f"train_dataset.dataloader.tokenizer={tmp_path / 'tok'}",
        "train_dataset.dataloader.chat_template=chatml",
        "train_dataset.dataloader.seq_length=32",
        "model.seq_length=32",
        "model.vocab_size=64",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "model.head_dim=8",
        *extra,
    ]
    out = []
    for s in sets:
        out += ["--set", s]
    return out


def _plain(argv: list[str]) -> list[str]:
    return [a for a in argv if a != "--set"]


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, **kw):
        if state.global_step == self.step:
            kw["trainer"].request_stop("test stop")


@pytest.mark.slow
def test_sft_recipe_trains_adapters_and_resumes_exactly(tmp_path):
    from lmforge.models import build_model, save_hf_pretrained

    write_tokenizer(tmp_path / "tok")
    words = WORDS[:40]
    rows = [
        {
            "messages": [
                {"role": "user", "content": " ".join(words[(i + k) % 40] for k in range(3))},
                {"role": "assistant", "content": " ".join(words[(i + 3 + k) % 40] for k in range(1 + i % 4))},
            ]
        }
        for i in range(200)
    ]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = load_config(RECIPE, _plain(_overrides(tmp_path, "x", 1)))
    torch.manual_seed(0)
    save_hf_pretrained(build_model(cfg.model), tmp_path / "hf")
    argv = ["train", "--config", str(RECIPE)]
    assert main([*argv, *_overrides(tmp_path, "straight", 6)]) == 0
    # Stop after step 3 (a checkpoint is written on stop), then resume in a new run.
    trainer = build_trainer(load_config(RECIPE, _plain(_overrides(tmp_path, "split", 6))))
    trainer.callbacks.add(StopAt(3))
    trainer.fit()
    trainer.dataloader.close()
    resume = _overrides(tmp_path, "split", 6, f"checkpoint.load_path={tmp_path / 'split' / 'ckpt'}")
    resume += ["--set", "checkpoint.no_load_optim=false"]
    assert main([*argv, *resume]) == 0
    a = [
        (r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")
    ]
    b = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "split" / "metrics.jsonl")]
    assert len(a) == 6 and a == b


@pytest.mark.slow
@pytest.mark.distributed
def test_sft_recipe_under_two_data_parallel_ranks(tmp_path):
    """2 gloo ranks: each reads its own documents; FSDP2 with LoRA; a checkpoint resumes on 2 ranks."""
    from lmforge.models import build_model, save_hf_pretrained
    from train.test_distributed import torchrun

    write_tokenizer(tmp_path / "tok")
    rows = [
        {"prompt": " ".join(WORDS[(i + k) % 40] for k in range(3)), "response": WORDS[(i + 5) % 40]}
        for i in range(100)
    ]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = load_config(RECIPE, _plain(_overrides(tmp_path, "x", 1)))
    torch.manual_seed(0)
    save_hf_pretrained(build_model(cfg.model), tmp_path / "hf")
    sets = _plain(_overrides(tmp_path, "dp2", 2, "train_dataset.num_parallel_workers=0"))
    torchrun(2, str(RECIPE), *sets)
    sets = _plain(_overrides(tmp_path, "dp2", 3, f"checkpoint.load_path={tmp_path / 'dp2' / 'ckpt'}"))
    torchrun(
        2,
        str(RECIPE),
        *sets,
        "checkpoint.no_load_optim=false",
        "train_dataset.num_parallel_workers=0",
    )
    steps = [r["step"] for r in read_metrics(tmp_path / "dp2" / "metrics.jsonl")]
    assert steps == [1, 2, 3]


def test_a_missing_tokenizer_is_a_check_warning_and_refused_by_train_before_building(tmp_path, capsys):
    # Before: `check` said nothing (exit 0, no warning) and `train` refused it only after building the model.
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}])
    sets = ["--set", f"train_dataset.dataloader.data_path=['{tmp_path / 'chat.jsonl'}']"]
    sets += ["--set", f"train_dataset.dataloader.tokenizer={tmp_path / 'nope.json'}"]
    sets += ["--set", f"output_dir={tmp_path / 'run'}", "--set", f"checkpoint.save_path={tmp_path / 'ck'}"]
    needle = f"train_dataset.dataloader.tokenizer: '{tmp_path / 'nope.json'}' not found"
    assert main(["check", "--config", str(RECIPE), *sets]) == 0
    assert needle in capsys.readouterr().out
    assert main(["train", "--config", str(RECIPE), *sets]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Nothing was built" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("eod beyond the vocabulary", "train_dataset.dataloader.eod must be a token id in 0 .. 63; got 100"),
        ("not a tokenizer", "is not a valid Hugging Face tokenizer.json"),
    ],
)
def test_a_tokenizer_the_loader_cannot_use_is_a_check_warning_and_refused_by_train_before_building(
    tmp_path, capsys, case, needle
):
    # Before: `check` passed both (exit 0, no warning) and `train` refused them after building the model.
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}])
    extra = []
    if case == "not a tokenizer":
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "tokenizer.json").write_text('{"this is": "not a tokenizer"}')
    else:
        write_tokenizer(tmp_path / "tok")
        extra = ["train_dataset.dataloader.eod=100"]
    argv = _overrides(tmp_path, "run", 1, *extra)
    assert main(["check", "--config", str(RECIPE), *argv]) == 0
    out = capsys.readouterr().out
    assert needle in out and "training will refuse to start until it is fixed" in out, out
    assert main(["train", "--config", str(RECIPE), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Nothing was built" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
