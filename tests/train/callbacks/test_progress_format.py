"""What a person reads in the step lines: durations, ETA, epoch, throughput with a unit that shows
its digits, perplexity readable when huge."""

from __future__ import annotations

import math

from lmforge.train.callbacks import logging as step_log
from lmforge.train.callbacks.logging import RunClock, format_duration, format_step_line, readable_number

METRICS = {
    "step": 3,
    "consumed_samples": 12,
    "global_batch_size": 4,
    "loss": 2.5,
    "lr": 1e-3,
    "grad_norm": 0.5,
    "step_time": 0.2,
    "tokens_per_s": 320.0,
    "mfu": 0.02,
    "memory_gib": 0.5,
}


def test_throughput_has_a_unit_that_shows_its_digits():
    cpu = format_step_line({**METRICS, "tflops_per_device": 0.0113}, 10)
    assert "throughput:  11.30G" in cpu and "0.00T" not in cpu
    assert "throughput: 312.00T" in format_step_line({**METRICS, "tflops_per_device": 312.0}, 10)
    assert "throughput" not in format_step_line({**METRICS, "tflops_per_device": 0.0}, 10)  # nothing, not 0


def test_durations_and_large_perplexities():
    assert format_duration(3723.4) == "1:02:03"
    assert format_duration(2 * 86400 + 5) == "2d 0:00:05"
    assert readable_number(24.88) == "24.8800"
    assert readable_number(math.exp(80)) == "5.5406e+34"
    assert readable_number(math.inf) == "inf"


def test_eta_follows_the_pace_after_the_first_step(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_log.time, "perf_counter", lambda: now[0])
    clock = RunClock()
    clock.begin(0)
    now[0] = 130.0  # the first step: 30 s of compilation and warm-up
    clock.progress(1, 11)
    now[0] = 134.0  # then 2 s per step
    p = clock.progress(3, 11)
    assert p["elapsed"] == "0:00:34" and p["eta"] == format_duration(8 * 2.0)


class _Loader:
    epoch = 2


def test_epoch_from_the_loader_and_in_the_line():
    p = RunClock().progress(1, 4, _Loader())
    assert p["epoch"] == 2
    assert "| epoch: 2 | elapsed: " in format_step_line({**METRICS, "tflops_per_device": 1.0}, 4, p)


def test_text_loader_counts_its_epochs(tmp_path):
    from data.text_helpers import write_jsonl, write_tokenizer
    from lmforge.config import validate_section
    from lmforge.data import build_dataloader

    tok = write_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "d.jsonl", [{"text": "w1 w2 w3"}] * 4)  # 4 x (3 + eod) = 16 tokens
    section = {
        "dataloader": {
            "type": "TextDataLoader",
            "data_path": [str(tmp_path / "d.jsonl")],
            "tokenizer": tok,
            "seq_length": 7,
        },
        "num_parallel_workers": 0,
    }
    loader = build_dataloader(validate_section("train_dataset", section), local_batch_size=1, seq_length=7)
    epochs = []
    for _ in range(6):
        next(loader)
        epochs.append(loader.epoch)
    assert epochs[0] == 1 and epochs[-1] >= 2 and epochs == sorted(epochs)


def test_megatron_loader_counts_its_epochs(tmp_path):
    import numpy as np

    from lmforge.config import validate_section
    from lmforge.data import IndexedDatasetWriter, build_dataloader

    with IndexedDatasetWriter(tmp_path / "docs", np.uint16) as writer:
        for i in range(10):
            writer.add_document([1 + i % 5] * 7 + [0])  # 80 tokens: 10 samples of 8 (+1) per epoch
    section = {
        "dataloader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "config": {
                "seq_length": 7,
                "eod": 0,
                "data_path": [str(tmp_path / "docs")],
                "split": "1,0,0",
                "path_to_cache": str(tmp_path / "cache"),
            },
        },
        "num_parallel_workers": 0,
    }
    loader = build_dataloader(validate_section("train_dataset", section), local_batch_size=2, seq_length=7)
    per_epoch = loader.steps_per_epoch
    epochs = []
    for _ in range(2 * per_epoch + 1):
        next(loader)
        epochs.append(loader.epoch)
    assert epochs == [1] * per_epoch + [2] * per_epoch + [3]
