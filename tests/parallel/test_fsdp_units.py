"""FSDP units at one rank (parallel/fsdp.py): where nothing is sharded and the 16-bit compute copies are
kept, consecutive layers share a unit up to ``ONE_RANK_UNIT_PARAMS`` parameters and a small model is one
unit; in fp32 (copies resharded) every layer keeps its own unit. Grouping changes no number: training
is bitwise the same as with a unit per layer."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from lmforge.config import validate_section
from lmforge.parallel import fsdp
from lmforge.train.builder import build_training_model

from .test_fsdp_one_rank import SECTION as TWO_LAYERS
from .test_fsdp_one_rank import train_steps

SECTION = {**TWO_LAYERS, "num_hidden_layers": 4}
DEFAULT_LIMIT = fsdp.ONE_RANK_UNIT_PARAMS


def _units(model) -> list[list[str]]:
    """Each FSDP parameter group below the root, as the names of the modules it was applied to."""
    groups: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and module is not model:
            group = module._get_fsdp_state()._fsdp_param_group
            groups.setdefault(id(group), []).append(name)
    return list(groups.values())


def _layer_params(model) -> int:
    return sum(p.numel() for p in model.decoder.layers[0].parameters())


def test_group_sizes_runs_consecutive_layers_up_to_the_limit():
    assert fsdp.group_sizes([10, 10, 10, 50, 5, 5], 25) == [[0, 1], [2], [3], [4, 5]]
    assert fsdp.group_sizes([3, 3, 3], 0) == [[0], [1], [2]]  # nothing fits: a unit per layer
    assert fsdp.group_sizes([], 10) == []


def test_a_small_model_at_one_rank_in_bf16_is_one_unit():
    model, _ = build_training_model(validate_section("model", dict(SECTION)), seed=0, device="cpu")
    assert isinstance(model, FSDPModule)
    assert _units(model) == []  # no unit below the root


def test_layers_are_grouped_up_to_the_bound(monkeypatch):
    probe, _ = build_training_model(validate_section("model", dict(SECTION)), seed=0, device="cpu")
    # Room for two layers per unit, less than the whole model.
    monkeypatch.setattr(fsdp, "ONE_RANK_UNIT_PARAMS", 2 * _layer_params(probe))
    model, _ = build_training_model(validate_section("model", dict(SECTION)), seed=0, device="cpu")
    assert _units(model) == [
        ["decoder.layers.0", "decoder.layers.1"],
        ["decoder.layers.2", "decoder.layers.3"],
    ]


@pytest.mark.parametrize("parallelism", [{}, {"data_parallel_shard_strategy": "optim_grads"}])
def test_fp32_keeps_a_unit_per_layer(parallelism):
    # In fp32 a larger unit would hold more fp32 copies and gradients at once; that holds whether the
    # copies are resharded after forward (the default) or kept to backward (ZeRO-2).
    model, _ = build_training_model(
        validate_section("model", {**SECTION, "compute_dtype": "float32"}),
        seed=0,
        device="cpu",
        parallelism=validate_section("parallelism", parallelism),
    )
    assert _units(model) == [[f"decoder.layers.{i}"] for i in range(4)]


def _train(limit: int, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(fsdp, "ONE_RANK_UNIT_PARAMS", limit)
    model, ctx = build_training_model(validate_section("model", dict(SECTION)), seed=0, device="cpu")
    return train_steps(model, ctx, SECTION)


@pytest.mark.parametrize("layers_per_unit", [2, None])  # None: the whole model in the root unit
def test_grouped_units_train_bitwise_like_a_unit_per_layer(layers_per_unit, monkeypatch):
    probe, _ = build_training_model(validate_section("model", dict(SECTION)), seed=0, device="cpu")
    per_layer = _train(0, monkeypatch)
    limit = DEFAULT_LIMIT if layers_per_unit is None else layers_per_unit * _layer_params(probe)
    grouped = _train(limit, monkeypatch)
    assert per_layer.keys() == grouped.keys()
    for name in per_layer:
        assert torch.equal(per_layer[name], grouped[name]), name
