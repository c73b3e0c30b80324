"""Validation loss / perplexity, evaluation every N steps, and the order of the built-in callbacks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import load_config, validate_section
from lmforge.errors import ConfigError
from lmforge.train.callbacks.base import CallbackHandler, TrainerCallback
from lmforge.train.callbacks.evaluation import EvaluationCallback
from lmforge.train.callbacks.max_logits import MaxLogitsMonitor
from lmforge.train.callbacks.monitor import MemoryCallback, MoeMonitorCallback, TrainStateMonitorCallback
from lmforge.train.callbacks.profiler import ProfilerCallback
from lmforge.train.callbacks.tensorboard import TensorBoardCallback
from lmforge.train.callbacks.validation import eval_settings, evaluate

from .helpers import FakeState, TinyLM, drive, micro_batches


def _reference_loss(model, batches):
    """Token mean over all batches, with F.cross_entropy(reduction='sum') as the independent reference."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(b["input_ids"]).logits
            labels = b["labels"]
            total += float(
                F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            )
            tokens += int((labels != -100).sum())
    return total / tokens, tokens


def test_evaluate_is_the_token_mean_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = TinyLM()
    batches = micro_batches(3)
    batches[1]["labels"][0, :5] = -100  # uneven valid-token counts: a mean of batch means would differ
    expected, tokens = _reference_loss(model, batches)
    model.train()
    calls_before = model.calls.clone()
    result = evaluate(model, batches)
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-6)
    assert result.tokens == tokens and result.batches == 3
    assert model.training
    assert torch.equal(model.calls, calls_before)  # buffers restored
    assert evaluate(model, batches, max_batches=1).batches == 1


def test_evaluation_callback_every_interval_adds_metrics():
    model = TinyLM()
    batches = micro_batches(2, seed=99)
    cb = EvaluationCallback(interval=2, steps=1, loader_factory=lambda: batches)
    metrics = drive([cb], model, steps=4, micro=1)
    assert ["val_loss" in m for m in metrics] == [False, True, False, True]
    expected, _ = _reference_loss(model, batches[:1])
    assert metrics[3]["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics[3]["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-6)


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"eval_interval": -1}, "eval_interval must be a non-negative int"),
        ({"eval_interval": 5, "eval_steps": 0}, "eval_steps must be"),
    ],
)
def test_eval_settings_are_checked_at_load(base_config, cfg, needle):
    # TrainConfig owns these keys' rule; eval_settings reads the typed values and checks nothing again.
    with pytest.raises(ConfigError, match=needle):
        load_config({**base_config, **cfg})


def test_eval_settings_defaults(base_config):
    cfg = load_config(base_config)
    s = eval_settings(cfg)
    assert (s.interval, s.steps) == (0, None)
    assert EvaluationCallback.from_config(cfg) is None
    cfg = load_config(
        {**base_config, "eval_interval": 3, "eval_steps": 2, "eval_dataset": base_config["train_dataset"]}
    )
    assert (eval_settings(cfg).interval, eval_settings(cfg).steps) == (3, 2)
    assert EvaluationCallback.from_config(cfg).interval == 3


class _Recorder(TrainerCallback):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def on_step_end(self, args, state, **kwargs):
        self.log.append(self.name)


def test_builtin_order_metrics_producers_before_tensorboard(tmp_path):
    """Producers of step metrics (memory, validation, max logits) run before TensorBoard writes them;
    the profiler runs first so that its window brackets the whole step."""
    callbacks = [
        TensorBoardCallback(validate_section("monitor.tensorboard", {}), tmp_path),
        MaxLogitsMonitor(),
        EvaluationCallback(1),
        TrainStateMonitorCallback(validate_section("monitor.train_state", {}), tmp_path),
        MoeMonitorCallback(validate_section("monitor.moe_monitor", {}), tmp_path),
        MemoryCallback("cpu"),
        ProfilerCallback(validate_section("profiler", {}), tmp_path),
    ]
    handler = CallbackHandler(callbacks)
    names = [type(c).__name__ for c in handler.callbacks]
    assert names == [
        "ProfilerCallback",
        "MemoryCallback",
        "TrainStateMonitorCallback",
        "MoeMonitorCallback",
        "EvaluationCallback",
        "MaxLogitsMonitor",
        "TensorBoardCallback",
    ]


def test_handler_calls_hooks_in_order():
    log: list[str] = []
    handler = CallbackHandler([_Recorder("a", log), _Recorder("b", log)])
    handler.call("on_step_end", None, FakeState())
    assert log == ["a", "b"]
