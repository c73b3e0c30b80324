"""``--set`` overrides: dotted keys, YAML values, validated like the file."""

from __future__ import annotations

from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.errors import ConfigError


def test_values_are_parsed_as_yaml(base_config: dict[str, Any]) -> None:
    cfg = load_config(
        base_config,
        [
            "training.steps=20",
            "optimizer.betas=[0.9,0.99]",
            "optimizer.eps=1e-6",
            "training.deterministic=true",
            "checkpoint.save_path=out/ckpt",
            "model.rope_scaling={type: yarn, factor: 4}",
        ],
    )
    assert cfg.training.steps == 20
    assert cfg.optimizer.typed.hyper.betas == (0.9, 0.99)
    assert cfg.optimizer.typed.hyper.eps == 1e-6
    assert cfg.training.deterministic is True
    assert cfg.checkpoint.save_path == "out/ckpt"
    assert cfg.model.rope_scaling.factor == 4


def test_later_overrides_win_and_may_create_sections(base_config: dict[str, Any]) -> None:
    cfg = load_config(base_config, ["profiler.enable_profiling=True", "training.steps=5", "training.steps=6"])
    assert cfg.profiler.enable_profiling is True and cfg.training.steps == 6


def test_list_items_can_be_set(base_config: dict[str, Any]) -> None:
    base_config["callbacks"] = [{"type": "A"}]
    cfg = load_config(base_config, ["callbacks[0].type=B", "callbacks.1={type: C}"])
    assert [c.type for c in cfg.callbacks] == ["B", "C"]


def test_mapping_of_overrides(base_config: dict[str, Any]) -> None:
    cfg = load_config(base_config, {"training.steps": 7, "optimizer.betas": [0.8, 0.9]})
    assert cfg.training.steps == 7 and cfg.optimizer.typed.hyper.betas == (0.8, 0.9)


def test_override_is_validated_like_the_file(base_config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"training\.global_batch_size in config must be positive"):
        load_config(base_config, ["training.global_batch_size=0"])
    with pytest.raises(ConfigError, match=r"training\.global_batch_sze \(did you mean global_batch_size\?\)"):
        load_config(base_config, ["training.global_batch_sze=4"])
    with pytest.raises(ConfigError, match=r"training\.steps must be an integer"):
        load_config(base_config, ["training.steps=twenty"])


@pytest.mark.parametrize(
    ("item", "pattern"),
    [
        ("training.steps", r"expected KEY=VALUE"),
        ("=3", r"empty or invalid key"),
        ("training.steps.x=3", r"training\.steps is not a mapping"),
        ("callbacks[3].type=A", r"callbacks\[3\] does not exist"),
        ("training.steps=[1", r"YAML parse error in the value of --set training\.steps"),
        # these used to set training.steps silently (a typo taken for a key)
        ("training..steps=3", r"the key 'training\.\.steps' has an empty part"),
        (".training.steps=3", r"has an empty part"),
        ("training.=3", r"has an empty part"),
    ],
)
def test_malformed_overrides(base_config: dict[str, Any], item: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(base_config, [item])
