"""``training.epochs``: passes over the training data instead of a step count, from the user's side.

The reference for every count is the data itself (documents written here, one per packed row, so a
pass is exactly that many rows) and the arithmetic of the batch, not lmforge's earlier output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from lmforge.cli import main
from lmforge.config import dump_yaml, load_config
from lmforge.errors import ConfigError
from lmforge.lr import build_scheduler
from lmforge.parallel.plan import BatchSchedule, RunPlan

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from data.text_helpers import WORDS, token_id, write_jsonl, write_tokenizer  # noqa: E402

DOCS = 12  # documents, one per row: pack whole, each "wI" + EOD fills 2 of the 3 tokens of a row


def _config(tmp_path: Path, *, epochs: int = 2, shuffle: bool = False, **training) -> dict:
    tok = write_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "docs.jsonl", [{"text": WORDS[i]} for i in range(DOCS)])
    return {
        "output_dir": str(tmp_path / "run"),
        "training": {"epochs": epochs, "local_batch_size": 2, "global_batch_size": 4, "seed": 3, **training},
        "lr_scheduler": {"type": "CosineWithWarmUpLR", "learning_rate": 3.0e-3, "warmup_steps": 1},
        "train_dataset": {
            "dataloader": {
                "type": "TextDataLoader",
                "data_path": [str(tmp_path / "docs.jsonl")],
                "tokenizer": tok,
                "pack": "whole",
                "seq_length": 2,
                "shuffle": shuffle,
                "shuffle_buffer": 64,
            },
            "num_parallel_workers": 0,
        },
        "model": {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            "num_hidden_layers": 1,
            "hidden_size": 16,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 32,
            "vocab_size": 64,
            "seq_length": 2,
            "compute_dtype": "float32",
        },
    }


def _lmforge(tmp_path: Path, *args: str, config: dict | None = None) -> subprocess.CompletedProcess:
    if config is not None:
        (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
        args = (*args, "--config", str(tmp_path / "train.yaml"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", "lmforge", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )


def _documents_served(cfg, micro_batches: int) -> tuple[list[int], list[int]]:
    """The document (its word's token id) of each row the training loader serves, in order, and the
    loader's epoch after each micro-batch."""
    from lmforge.data import build_dataloader

    loader = build_dataloader(
        cfg.train_dataset,
        local_batch_size=cfg.training.local_batch_size,
        seed=cfg.training.seed,
        seq_length=2,
    )
    rows, epochs = [], []
    for _ in range(micro_batches):
        rows += [int(row[0]) for row in next(loader)["input_ids"]]
        epochs.append(loader.epoch)
    return rows, epochs


@pytest.mark.parametrize("shuffle", [False, True])
def test_epochs_train_every_document_that_many_times(tmp_path, shuffle):
    cfg = load_config(_config(tmp_path, shuffle=shuffle))
    plan = RunPlan.from_config(cfg, 1)
    assert plan.total_steps == 2 * DOCS // 4  # two passes of 12 one-row documents, 4 rows a step
    assert plan.schedule.total_steps == plan.total_steps  # the lr schedule spans the derived steps
    served, epochs = _documents_served(cfg, plan.total_steps * plan.accumulation_steps)
    assert epochs == [1] * 6 + [2] * 6  # the pass of the rows just served (2 rows a micro-batch)
    words = [token_id(WORDS[i]) for i in range(DOCS)]
    assert Counter(served) == {w: 2 for w in words}
    first, second = served[:DOCS], served[DOCS:]
    assert sorted(first) == sorted(second) == sorted(words)  # each pass holds every document once
    if shuffle:
        assert first != words and second != first  # each pass in its own order
    else:
        assert first == second == words


def test_epochs_derive_whole_steps_and_leave_a_partial_batch_out(tmp_path):
    # 3 passes of 12 rows = 36 rows in steps of 8: 4 whole steps (32 rows); the 4 left are not trained.
    cfg = load_config(_config(tmp_path, epochs=3, global_batch_size=8))
    assert RunPlan.from_config(cfg, 1).total_steps == 4
    # Two data-parallel ranks read 6 documents each: 12 rows per rank in 2 passes, steps of 2 x 2 x 2.
    cfg = load_config(_config(tmp_path, epochs=2, global_batch_size=8))
    assert RunPlan.from_config(cfg, 2).total_steps == 2 * DOCS // 8


def test_steps_within_follows_the_batch_ramp_up():
    schedule = BatchSchedule(global_batch_size=8, local_batch_size=2, data_parallel=1, rampup=(4, 4, 8))
    # Ramp-up: steps of 4 samples until 8 are consumed, then steps of 8.
    assert [schedule.steps_within(n) for n in (3, 4, 8, 15, 16, 24, 31)] == [0, 1, 2, 2, 3, 4, 4]


def test_steps_and_epochs_are_one_or_the_other(tmp_path):
    raw = _config(tmp_path)
    with pytest.raises(ConfigError, match=r"training\.steps \(5\) and training\.epochs \(2\) are both set"):
        load_config({**raw, "training": {**raw["training"], "steps": 5}})
    with pytest.raises(ConfigError, match=r"training\.epochs must be a positive"):
        load_config({**raw, "training": {**raw["training"], "epochs": 0}})
    with pytest.raises(ConfigError, match=r"training\.steps: null"):
        load_config({**raw, "training": {"steps": None}})
    # A recipe's steps replaced from the command line.
    steps_file = {**raw, "training": {**raw["training"], "steps": 5}}
    steps_file["training"].pop("epochs")
    cfg = load_config(steps_file, ["training.steps=null", "training.epochs=2"])
    assert cfg.training.epochs == 2 and "steps" not in cfg.training.to_dict()  # written back with epochs
    # A checkpoint's config.yaml of an epochs run (the derived steps in memory) reads back as it was.
    derived = cfg.with_derived_steps(6)
    assert derived.training.steps == 6
    assert build_scheduler(derived.lr_scheduler, derived.training.steps).total_steps == 6
    again = load_config(yaml.safe_load(dump_yaml(derived)))
    assert again.training.epochs == 2 and "steps" not in again.training.model_fields_set


def test_the_lr_schedule_is_checked_against_the_derived_steps(tmp_path):
    raw = _config(tmp_path)
    raw["lr_scheduler"] = {"type": "WarmUpStableDecayLR", "learning_rate": 1e-3, "decay_start_steps": 9}
    with pytest.raises(ConfigError, match=r"decay_start.*derived from training\.epochs 2"):
        RunPlan.from_config(load_config(raw), 1)


def test_megatron_data_counts_passes_of_its_samples(tmp_path):
    from lmforge.data import IndexedDatasetWriter

    prefix = tmp_path / "docs"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(10):
            writer.add_document([1, 2, 3, 4, 5, 6, 7, 8, 0])  # 90 tokens: (90 - 1) // 4 = 22 samples
    raw = _config(tmp_path, epochs=3)
    raw["model"]["seq_length"] = 4
    raw["train_dataset"] = {
        "dataloader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "sizes": [None, 0, 0],
            "config": {"seq_length": 4, "split": "1,0,0", "data_path": [str(prefix)]},
        },
        "drop_remainder": True,
    }
    from lmforge.data import build_dataset

    dataset, _ = build_dataset(load_config(raw).train_dataset, phase="train")
    assert len(dataset) == 22  # one pass
    # 3 passes = 66 samples in steps of 4: 16 whole steps (2 samples of the last pass left out).
    assert RunPlan.from_config(load_config(raw), 1).total_steps == 16
    # Two ranks of 2 rows: micro-steps of 4 samples, drop_remainder drops 2 samples of every pass.
    raw["training"]["global_batch_size"] = 8
    assert RunPlan.from_config(load_config(raw), 2).total_steps == 3 * 20 // 8
    raw["train_dataset"]["dataloader"]["sizes"] = [100, 0, 0]
    with pytest.raises(ConfigError, match=r"sizes\[0\] \(100\)"):
        RunPlan.from_config(load_config(raw), 1)


@pytest.mark.slow
def test_cli_check_shows_the_steps_and_train_runs_them(tmp_path, capsys):
    raw = _config(tmp_path, shuffle=True)
    raw["checkpoint"] = {"save_path": str(tmp_path / "ckpt"), "save_interleaved_steps": 2, "save_max": 3}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw))
    assert main(["check", "--config", str(tmp_path / "train.yaml")]) == 0
    out = capsys.readouterr().out
    assert "total steps: 6" in out and "training.epochs 2" in out
    assert main(["check", "--config", str(tmp_path / "train.yaml"), "--set", "training.steps=5"]) == 2
    err = capsys.readouterr().err
    assert "training.steps (5) and training.epochs (2) are both set" in err and "Traceback" not in err
    assert main(["lr", "--config", str(tmp_path / "train.yaml"), "-o", str(tmp_path / "lr.png")]) == 0
    assert "(training.steps 6)" in capsys.readouterr().out  # the schedule drawn over the derived steps

    train = _lmforge(tmp_path, "train", config=raw)
    assert train.returncode == 0, train.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    # The step line's epoch is the pass of the step's rows: 12 rows a pass, 4 a step.
    log = (tmp_path / "run" / "train.log").read_text()
    assert re.findall(r"step: \[\d/6\] \| epoch: (\d)", log) == ["1", "1", "1", "2", "2", "2"]
    # Resume in the middle of the first pass (8 of its 12 rows) is exact: the same losses after it.
    load = f"checkpoint.load_path={tmp_path / 'ckpt' / 'iteration_00000002'}"
    resume = [
        "train",
        "--config",
        str(tmp_path / "train.yaml"),
        "--set",
        load,
        "--output-dir",
        str(tmp_path / "resumed"),
    ]
    assert main(resume) == 0  # in this process: the same command, without a second start-up
    again = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again if "loss" in r] == [3, 4, 5, 6]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert all(r["loss"] == losses[r["step"]] for r in again if "loss" in r)


def test_the_doctor_reads_the_derived_steps_of_an_epochs_run(tmp_path):
    from lmforge.tools.doctor.evidence import FACTS_FILE, RunEvidence, _read_facts
    from lmforge.tools.doctor.rule_base import _steps_configured

    # The run's config.yaml keeps epochs (no steps); doctor_facts.json holds the steps it derived.
    (tmp_path / FACTS_FILE).write_text(json.dumps({"training_steps": 40}))
    facts = _read_facts(tmp_path / FACTS_FILE)
    assert _steps_configured(RunEvidence(config={"training": {"epochs": 2}}, facts=facts)) == 40
    assert _steps_configured(RunEvidence(config={"training": {"steps": 7}}, facts=facts)) == 7


def test_epochs_need_the_training_data_to_count_and_say_so(tmp_path):
    raw = _config(tmp_path)
    raw["train_dataset"]["dataloader"]["data_path"] = [str(tmp_path / "missing.jsonl")]
    with pytest.raises(
        ConfigError, match=r"training\.epochs 2 counts the steps from the training data: .*missing\.jsonl"
    ):
        RunPlan.from_config(load_config(raw), 1)
