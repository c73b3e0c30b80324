"""The fine-tuning walk-through of docs/guide.md ("Fine-tune a Hugging Face model on your chat data"),
command by command as a user runs it, with --set overrides that keep it to seconds (2 steps each,
float32 compute for CPUs without native bf16)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmforge.cli import main

ROOT = Path(__file__).resolve().parents[3]
FAST = ["--set", "training.steps=2", "--set", "model.compute_dtype=float32"]


def _walkthrough_commands() -> list[list[str]]:
    """The commands of the walk-through's code block in docs/guide.md."""
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    section = text.split("## Fine-tune a Hugging Face model on your chat data", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            commands.append(re.findall(r'"[^"]*"|\S+', line))
    return [[a.strip('"') for a in c] for c in commands]


@pytest.mark.slow
def test_the_guide_walkthrough_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    commands = _walkthrough_commands()
    assert [c[:2] for c in commands] == [
        ["lmforge", "data"],
        ["lmforge", "train"],
        ["lmforge", "convert"],
        ["lmforge", "train"],
        ["lmforge", "convert"],
        ["lmforge", "convert"],
        ["lmforge", "generate"],
        ["lmforge", "eval"],
        ["lmforge", "eval"],
    ]
    extra = {
        "train": [*FAST, "--set", "eval_interval=0", "--set", "checkpoint.save_interleaved_steps=2"],
        "eval": ["--set", "eval_steps=2", "--set", "model.compute_dtype=float32", "--json"],
        "generate": ["--max-new-tokens", "8"],
    }
    results = []
    for command in commands:
        capsys.readouterr()
        argv = command[1:] + extra.get(command[1], [])
        assert main(argv) == 0, (argv, capsys.readouterr().err[-3000:])
        out = capsys.readouterr().out
        if command[1] == "generate":
            answer = out
        if command[1] == "eval":
            results.append(json.loads(out.strip().splitlines()[-1]))
    assert (tmp_path / "output/sft_chat/merged/chat_template.jinja").is_file()  # the recipe's template
    assert (tmp_path / "output/sft_chat/adapter/adapter_config.json").is_file()
    assert answer.endswith("\n")
    # The pretraining and the LoRA SFT checkpoints, each evaluated with its own config.yaml.
    assert [r["checkpoint"] for r in results] == ["output/demo/checkpoints", "output/sft_chat/checkpoints"]
    assert all(r["batches"] == 2 and 0 < r["val_loss"] < float("inf") for r in results)
