"""FSDP units at one rank (parallel/fsdp.py): where nothing is sharded and the 16-bit compute copies are
kept, consecutive layers share a unit up to ``ONE_RANK_UNIT_PARAMS`` parameters and a small model is one
unit; in fp32 (copies resharded) every layer keeps its own unit. Grouping changes no number: training
is bitwise the same as with a unit per layer."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from lmforge.optim.builder import build_optimizer
from lmforge.parallel import fsdp
from lmforge.train.builder import build_training_model
from lmforge.train.step import TrainStep

SECTION = {
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "compute_dtype": "bfloat16",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "seq_length": 16,
    "tie_word_embeddings": True,
}
DEFAULT_LIMIT = fsdp.ONE_RANK_UNIT_PARAMS
ADAMW = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.01}


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
    model, _ = build_training_model(dict(SECTION), seed=0, device="cpu")
    assert isinstance(model, FSDPModule)
    assert _units(model) == []  # no unit below the root


def test_layers_are_grouped_up_to_the_bound(monkeypatch):
    probe, _ = build_training_model(dict(SECTION), seed=0, device="cpu")
    # Room for two layers per unit, less than the whole model.
    monkeypatch.setattr(fsdp, "ONE_RANK_UNIT_PARAMS", 2 * _layer_params(probe))
    model, _ = build_training_model(dict(SECTION), seed=0, device="cpu")
    assert _units(model) == [
        ["decoder.layers.0", "decoder.layers.1"],
        ["decoder.layers.2", "decoder.layers.3"],
    ]


def test_fp32_keeps_a_unit_per_layer():
    # In fp32 the copies are resharded after forward; a larger unit would hold more of them at once.
    model, _ = build_training_model({**SECTION, "compute_dtype": "float32"}, seed=0, device="cpu")
    assert _units(model) == [[f"decoder.layers.{i}"] for i in range(4)]


def _train(limit: int, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(fsdp, "ONE_RANK_UNIT_PARAMS", limit)
    model, ctx = build_training_model(dict(SECTION), seed=0, device="cpu")
    opt = build_optimizer(ADAMW, model, 1e-3)
    step = TrainStep(model, opt, None, max_norm=1.0, ctx=ctx)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        micro = []
        for _ in range(2):  # two micro-batches: the second reduction accumulates into the first's gradients
            ids = torch.randint(0, SECTION["vocab_size"], (2, SECTION["seq_length"] + 1), generator=g)
            micro.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()})
        step(micro)
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layers_per_unit", [2, None])  # None: the whole model in the root unit
def test_grouped_units_train_bitwise_like_a_unit_per_layer(layers_per_unit, monkeypatch):
    probe, _ = build_training_model(dict(SECTION), seed=0, device="cpu")
    per_layer = _train(0, monkeypatch)
    limit = DEFAULT_LIMIT if layers_per_unit is None else layers_per_unit * _layer_params(probe)
    grouped = _train(limit, monkeypatch)
    assert per_layer.keys() == grouped.keys()
    for name in per_layer:
        assert torch.equal(per_layer[name], grouped[name]), name
