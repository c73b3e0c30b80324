"""TensorBoard events, the profiler window and per-step peak memory."""

from __future__ import annotations

import gzip
import json
import mmap
import os
from pathlib import Path

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.train.callbacks.monitor import MemoryCallback
from lmforge.train.callbacks.monitor_hooks import PeakMemory
from lmforge.train.callbacks.profiler import ProfilerCallback
from lmforge.train.callbacks.tensorboard import TensorBoardCallback

from .helpers import TinyLM, drive


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_have_expected_tags_vs_step_and_samples(tmp_path):
    cb = TensorBoardCallback(
        validate_section("monitor.tensorboard", {"log_interval": 2, "queue_size": 5}), tmp_path
    )
    drive([cb], TinyLM(), steps=4, micro=1)
    assert cb.log_dir == tmp_path / "tensorboard"
    scalars = _scalars(cb.log_dir)
    for tag in ("loss", "learning-rate", "grad-norm", "iteration-time", "batch-size", "tokens-per-second"):
        assert tag in scalars, sorted(scalars)
        assert f"{tag} vs samples" in scalars
    assert [s for s, _ in scalars["loss"]] == [2, 4]  # every log_interval steps
    assert [s for s, _ in scalars["loss vs samples"]] == [8, 16]  # consumed samples (4 per step)
    assert [v for _, v in scalars["grad-norm"]] == pytest.approx([2.0, 4.0])
    assert [v for _, v in scalars["learning-rate"]] == pytest.approx([2e-3, 4e-3])


def test_tensorboard_output_dir_and_extra_metrics(tmp_path):
    cb = TensorBoardCallback(
        validate_section("monitor.tensorboard", {"output_dir": str(tmp_path / "tb")}), tmp_path
    )
    mem = MemoryCallback("cpu")
    drive([mem, cb], TinyLM(), steps=2, micro=1)
    scalars = _scalars(tmp_path / "tb")
    assert "memory/peak-rss-bytes" in scalars
    assert all(v > 0 for _, v in scalars["memory/peak-rss-bytes"])


def _trace_step_names(trace_dir: Path) -> set[str]:
    names = set()
    for path in trace_dir.glob("*.pt.trace.json*"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            data = json.load(f)
        names |= {
            e.get("name", "") for e in data.get("traceEvents", []) if "ProfilerStep#" in e.get("name", "")
        }
    return names


def _matmuls(step):
    a = torch.randn(64, 64)
    for _ in range(3):
        a = torch.tanh(a @ a)


def test_profiler_traces_only_the_configured_window(tmp_path):
    section = {
        "enable_profiling": True,
        "start_step": 2,
        "end_step": 3,
        "profiler_level": 1,
        "with_stack": False,
    }
    cb = ProfilerCallback(validate_section("profiler", section), tmp_path, rank=0)
    drive([cb], TinyLM(), steps=5, micro=1, work=_matmuls)
    trace_dir = tmp_path / "profile" / "rank_0"
    assert len(cb.profiler.trace_files()) == 1
    assert _trace_step_names(trace_dir) == {"ProfilerStep#2", "ProfilerStep#3"}


def test_profiler_other_rank_and_disabled_write_nothing(tmp_path):
    section = {
        "enable_profiling": True,
        "start_step": 1,
        "end_step": 1,
        "profiler_rank": [1],
        "output_path": str(tmp_path / "p"),
    }
    drive(
        [ProfilerCallback(validate_section("profiler", section), tmp_path, rank=0)],
        TinyLM(),
        steps=2,
        micro=1,
    )
    drive(
        [ProfilerCallback(validate_section("profiler", {"enable_profiling": False}), tmp_path, rank=0)],
        TinyLM(),
        steps=2,
        micro=1,
    )
    assert not (tmp_path / "p").exists() and not (tmp_path / "profile").exists()


def test_profiler_run_shorter_than_window_still_writes(tmp_path):
    section = {"enable_profiling": True, "start_step": 2, "end_step": 9, "with_stack": False}
    cb = ProfilerCallback(validate_section("profiler", section), tmp_path, rank=0)
    drive([cb], TinyLM(), steps=3, micro=1)
    assert _trace_step_names(tmp_path / "profile" / "rank_0") == {"ProfilerStep#2", "ProfilerStep#3"}


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"start_step": 0}, "must be positive"),
        ({"start_step": 3, "end_step": 2}, "less than or equal to end_step"),
        ({"profiler_level": "Level0"}, "Invalid profiler_level type"),
        ({"profiler_level": 3}, "must be 0, 1 or 2"),
    ],
)
def test_profiler_validation(section, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle):
        ProfilerCallback(validate_section("profiler", {"enable_profiling": True, **section}), tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="per-step RSS peak needs Linux")
def test_peak_rss_is_per_step():
    meter = PeakMemory("cpu")
    size = 256 * 1024 * 1024
    meter.begin_step()
    if not meter._can_reset_rss:
        pytest.skip("this kernel does not let the process reset its peak RSS")
    # An anonymous mapping touched page by page, unmapped on close: resident, then given back, whatever the
    # allocator keeps (the lmforge command's allocator defaults keep freed heap memory resident, and a test
    # calling lmforge.cli.main in this process applies them).
    big = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        big[offset] = 1
    big.close()
    first = meter.end_step()["peak_rss_bytes"]
    meter.begin_step()
    second = meter.end_step()["peak_rss_bytes"]
    assert first - second > size * 0.8, (first, second)


class _FakeEval:
    order = 25

    def on_train_begin(self, args, state, **kwargs): ...
    def on_step_begin(self, args, state, **kwargs): ...
    def on_train_end(self, args, state, **kwargs): ...

    def on_step_end(self, args, state, **kwargs):
        if state.global_step == 3:
            kwargs["metrics"].update({"val_loss": 2.5, "val_ppl": 12.18})


def test_tensorboard_writes_validation_between_logged_steps(tmp_path):
    cb = TensorBoardCallback(validate_section("monitor.tensorboard", {"log_interval": 2}), tmp_path)
    drive([_FakeEval(), cb], TinyLM(), steps=4, micro=1)
    scalars = _scalars(cb.log_dir)
    assert scalars["val-loss"] == [(3, 2.5)]
    assert [s for s, _ in scalars["val-ppl vs samples"]] == [12]
    assert [s for s, _ in scalars["loss"]] == [2, 4]
