"""load_config types model, optimizer and lr_scheduler per discriminator (lmforge.config.registry)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.config.registry import register_section_schema, section_values, typed_section
from lmforge.errors import ConfigError


def test_sections_are_typed_at_load(base_config: dict[str, Any]) -> None:
    from lmforge.lr.schedules import Schedule
    from lmforge.models.schema import TypedModel
    from lmforge.optim.options import OptimizerOptions

    cfg = load_config(base_config)
    assert isinstance(cfg.lr_scheduler.typed, Schedule) and cfg.lr_scheduler.typed.total_steps == 10
    assert isinstance(cfg.model.typed, TypedModel) and cfg.model.typed.config.hidden_size == 64
    assert isinstance(cfg.optimizer.typed, OptimizerOptions) and cfg.optimizer.typed.type == "AdamW"
    assert "CosineWithWarmUpLR" in section_values("lr_scheduler") and "qwen3" in section_values("model")


def test_errors_of_typed_sections_are_reported_together_at_load(base_config: dict[str, Any]) -> None:
    base_config["lr_scheduler"]["type"] = "CosineWithWarmupLR"
    base_config["model"]["num_hiden_layers"] = 2
    base_config["optimizer"] = {"type": "Adam"}
    with pytest.raises(ConfigError) as info:
        load_config(base_config)
    text = str(info.value)
    assert "3 problems" in text
    assert (
        "lr_scheduler.type: unknown scheduler 'CosineWithWarmupLR' (did you mean CosineWithWarmUpLR?)" in text
    )
    assert (
        "model.num_hiden_layers is not a key of model_type 'qwen3'. Did you mean 'num_hidden_layers'?" in text
    )
    assert "optimizer.type: Optimizer type Adam is not implemented yet" in text


def test_schema_warnings_are_config_warnings(base_config: dict[str, Any]) -> None:
    base_config["lr_scheduler"]["warmup_steps"] = 50  # longer than training.steps (10)
    base_config["model"]["torch_dtype"] = "bfloat16"
    warnings = " | ".join(load_config(base_config).warnings)
    assert "the warm-up (50 steps) is longer than training.steps (10)" in warnings
    assert "model.torch_dtype" in warnings


def test_registry_dispatch_catch_all_and_conflicts() -> None:
    seen: list[str] = []
    register_section_schema(
        "x_test", "Alpha", lambda s, p, c: seen.append(f"Alpha:{p}") or "a", noun="widget"
    )
    assert typed_section("x_test", "Alpha", {}, "x_test", {}) == "a" and seen == ["Alpha:x_test"]
    with pytest.raises(ValueError, match=r"x_test.type: unknown widget 'Alpah' \(did you mean Alpha\?\)"):
        typed_section("x_test", "Alpah", {}, "x_test", {})
    with pytest.raises(ValueError, match="already registered"):
        register_section_schema("x_test", "Alpha", lambda s, p, c: None)
    register_section_schema("x_test", "*", lambda s, p, c: "any")
    assert typed_section("x_test", "zzz", {}, "x_test", {}) == "any"
    assert typed_section("x_unregistered", "A", {}, "x", {}) is None


def test_import_lmforge_config_does_not_import_torch() -> None:
    # The torch-needing schemas (families, optimizers) register through providers on the first load.
    code = "import sys, lmforge.config; print('torch' in sys.modules)"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
