"""moe_monitor tokens per expert and MaxLogitsMonitor, on a real lmforge MoE model."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.models import build_model
from lmforge.parallel.activation import apply_activation_memory
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.max_logits import MaxLogitsMonitor
from lmforge.train.callbacks.monitor import MoeMonitorCallback
from lmforge.train.callbacks.registry import build_callback

from .helpers import drive

TOP_K = 2
SECTION = {
    "model_type": "qwen3_moe",
    "architectures": "Qwen3MoeForCausalLM",
    "num_hidden_layers": 3,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": TOP_K,
    "vocab_size": 32,
    "seq_length": 8,
    "compute_dtype": "float32",
}


def _model():
    torch.manual_seed(0)
    return build_model(validate_section("model", SECTION))


@pytest.mark.parametrize("recompute", [False, True])
def test_tokens_per_expert_sum_to_tokens_times_top_k(tmp_path, recompute):
    model = _model()
    if recompute:  # a recomputed forward must not count its tokens twice
        apply_activation_memory(
            model,
            validate_section("recompute", {"mode": "full", "full_recompute_layer": ["0-2"]}),
            None,
            None,
            3,
        )
    cb = MoeMonitorCallback(
        validate_section(
            "monitor.moe_monitor", {"save_tokens_per_expert_interval": 1, "target_layers": [0, 2]}
        ),
        tmp_path,
        num_layers=3,
    )
    drive([cb], model, steps=2, micro=2)
    records = [json.loads(line) for line in cb.path.read_text().splitlines()]
    # 2 steps x 2 micro-batches x 2 target layers
    assert [(r["step"], r["micro_step"], r["layer"]) for r in records] == [
        (s, m, layer) for s in (1, 2) for m in (1, 2) for layer in (0, 2)
    ]
    tokens = 2 * 8  # batch x seq of one micro-batch (helpers.micro_batches)
    for r in records:
        assert len(r["tpe"]) == 4
        assert sum(r["tpe"]) == tokens * TOP_K


def test_moe_monitor_interval_counts_micro_batches(tmp_path):
    cb = MoeMonitorCallback(
        validate_section("monitor.moe_monitor", {"save_tokens_per_expert_interval": 3, "target_layers": 1}),
        tmp_path,
        num_layers=3,
    )
    drive([cb], _model(), steps=3, micro=2)
    records = [json.loads(line) for line in cb.path.read_text().splitlines()]
    # micro-batches 3 and 6 of the run: step 2 micro 1, step 3 micro 2; target_layers: 1 -> layer 0 only
    assert [(r["step"], r["micro_step"], r["layer"]) for r in records] == [(2, 1, 0), (3, 2, 0)]


def test_moe_monitor_dense_target_layers_are_skipped(tmp_path):
    """The spec's skeleton targets layers that may be dense: skipped with a warning, not an error."""
    captured: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = captured.append
    logger = logging.getLogger("lmforge.train.callbacks.monitor_hooks")
    logger.addHandler(handler)
    try:
        cb = MoeMonitorCallback(
            validate_section(
                "monitor.moe_monitor", {"save_tokens_per_expert_interval": 1, "target_layers": [1, 7]}
            ),
            tmp_path,
        )
        drive([cb], _model(), steps=1, micro=1)
    finally:
        logger.removeHandler(handler)
    assert any("layers [7] have no experts" in r.getMessage() for r in captured)
    records = [json.loads(line) for line in cb.path.read_text().splitlines()]
    assert [r["layer"] for r in records] == [1]


def test_moe_monitor_needs_an_moe_model(tmp_path):
    from .helpers import TinyLM

    cb = MoeMonitorCallback(
        validate_section("monitor.moe_monitor", {"save_tokens_per_expert_interval": 1}), tmp_path
    )
    with pytest.raises(ConfigError, match="the model has no experts"):
        drive([cb], TinyLM(), steps=1, micro=1)


def test_max_logits_monitor_logs_per_layer_values_every_interval():
    model = _model()
    cb = build_callback(validate_section("callbacks", {"type": "MaxLogitsMonitor", "step_interval": 2}), 0)
    assert isinstance(cb, MaxLogitsMonitor)
    captured: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = captured.append
    logger = logging.getLogger("lmforge.train.callbacks.max_logits")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        metrics = drive([cb], model, steps=3, micro=1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [r.getMessage() for r in captured if "max_attention_logit" in r.getMessage()]
    steps_logged = sorted({int(re.match(r"step:\[\s*(\d+)/\s*3\]", line).group(1)) for line in lines})
    assert steps_logged == [2]
    per_layer = [line for line in lines if "self_attention:" in line]
    assert len(per_layer) == 3  # 3 attention layers
    values = re.search(r"\[([^\]]*)\]$", per_layer[0]).group(1).split(", ")
    assert len(values) == 4  # one per head
    assert all(float(v) > 0 for v in values)
    assert any(line.endswith("/mean: " + line.split(": ")[-1]) for line in lines)
    peak = max(v for vals in cb.last.values() for v in vals)
    assert metrics[1]["max_attention_logit"] == pytest.approx(peak)
    assert "max_attention_logit" not in metrics[0] and "max_attention_logit" not in metrics[2]
    # the running maximum is reset after every step
    assert all(float(layer.max_logits.abs().sum()) == 0 for layer in model.qk_clip_layers())


def test_max_logits_monitor_keeps_its_values_when_the_optimizer_resets_the_model():
    # Muon's QK-Clip resets the model's running maximum inside the optimizer step, before on_step_end.
    model = _model()

    class ResetLikeMuon(TrainerCallback):
        def on_step_end(self, args, state, **kwargs):
            model.reset_max_logits()

    cb = build_callback(validate_section("callbacks", {"type": "MaxLogitsMonitor", "step_interval": 1}), 0)
    drive([ResetLikeMuon(), cb], model, steps=1, micro=1)
    assert cb.last and all(v > 0 for values in cb.last.values() for v in values)


def test_max_logits_monitor_validation():
    with pytest.raises(ConfigError, match="step_interval must be a positive int, got 0"):
        MaxLogitsMonitor(step_interval=0)
    with pytest.raises(ConfigError, match="registered callbacks: .*MaxLogitsMonitor"):
        build_callback(validate_section("callbacks", {"type": "NoSuchCallback"}), 3)
