"""Derived quantities: data parallel, accumulation steps, warm-up steps (mindformers.md §4.1)."""

from __future__ import annotations

from typing import Any

import pytest

from lmforge.config import derive, load_config
from lmforge.errors import ConfigError


def _derive(base: dict[str, Any], world: int, **sections: dict[str, Any]) -> Any:
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return derive(load_config(base), world)


def test_pure_fsdp_shards_over_every_rank(base_config: dict[str, Any]) -> None:
    d = _derive(base_config, 8, training={"local_batch_size": 2, "global_batch_size": 64})
    assert (d.data_parallel, d.data_parallel_replicate, d.data_parallel_shard) == (8, 1, 8)
    assert d.accumulation_steps == 4 and d.effective_global_batch_size == 64 and d.warnings == []


def test_hsdp_split(base_config: dict[str, Any]) -> None:
    d = _derive(base_config, 8, parallelism={"data_parallel_shard": 2}, training={"global_batch_size": 8})
    assert (d.data_parallel_replicate, d.data_parallel_shard) == (4, 2)


def test_expert_parallel_does_not_reduce_data_parallel(base_config: dict[str, Any]) -> None:
    d = _derive(
        base_config,
        8,
        parallelism={"tensor_parallel": 2, "expert_parallel": 4},
        training={"global_batch_size": 8},
    )
    assert d.data_parallel == 4


def test_floor_division_warns(base_config: dict[str, Any]) -> None:
    d = _derive(base_config, 2, training={"local_batch_size": 2, "global_batch_size": 10})
    assert d.accumulation_steps == 2 and d.effective_global_batch_size == 8
    assert "effective global batch is 8" in d.warnings[0]


def test_idle_processes_warn(base_config: dict[str, Any]) -> None:
    d = _derive(base_config, 5, parallelism={"tensor_parallel": 2}, training={"global_batch_size": 4})
    assert d.data_parallel == 2 and "1 process(es) would idle" in d.warnings[0]


def test_rampup_batches_must_divide(base_config: dict[str, Any]) -> None:
    base_config["training"].update(global_batch_size=12, rampup_batch_size=[4, 4, 100])
    assert derive(load_config(base_config), 2).accumulation_steps == 6
    base_config["training"].update(rampup_batch_size=[3, 3, 100])
    with pytest.raises(ConfigError, match=r"training\.rampup_batch_size: the global batch size 3"):
        derive(load_config(base_config), 2)


@pytest.mark.parametrize(
    ("scheduler", "steps", "expected"),
    [
        ({"warmup_steps": 30}, 100, 30),
        ({"warmup_ratio": 0.1, "warmup_steps": 30}, 100, 10),
        ({"warmup_ratio": 0.015}, 1000, 15),
        ({"warmup_ratio": 0.019}, 100, 1),
        ({}, 100, None),
    ],
)
def test_warmup_steps(
    base_config: dict[str, Any], scheduler: dict[str, Any], steps: int, expected: Any
) -> None:
    base_config["lr_scheduler"] = {"type": "ConstantWarmUpLR", **scheduler}
    base_config["training"]["steps"] = steps
    assert derive(load_config(base_config)).warmup_steps == expected


@pytest.mark.parametrize(
    ("scheduler", "pattern"),
    [
        ({"warmup_ratio": 1.5}, r"lr_scheduler\.warmup_ratio must be in \[0, 1\]"),
        ({"warmup_ratio": "a"}, r"lr_scheduler\.warmup_ratio must be a number"),
        ({"warmup_steps": -1}, r"lr_scheduler\.warmup_steps must be >= 0"),
        ({"warmup_steps": 1.5}, r"lr_scheduler\.warmup_steps must be an integer"),
    ],
)
def test_bad_warmup(base_config: dict[str, Any], scheduler: dict[str, Any], pattern: str) -> None:
    base_config["lr_scheduler"] = {"type": "ConstantWarmUpLR", **scheduler}
    with pytest.raises(ConfigError, match=pattern):
        derive(load_config(base_config))
