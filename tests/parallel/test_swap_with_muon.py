"""Muon with ``swap.enable: true``: lifted. The original refuses the pairing ("Muon does not support
swap."); lmforge's swap only moves saved activations, so Muon's updates must equal a run without it."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.optim import build_optimizer
from lmforge.parallel.activation import plan_activation_memory

from .tiny_decoder import TinyDecoder

NUM_LAYERS = 4
MUON = {"type": "Muon", "qk_clip_enabled": False, "ns_dtype": "float32"}


def _train(model, steps=3):
    opt = build_optimizer(validate_section("optimizer", MUON), model, 2e-2)
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        torch.manual_seed(100 + step)  # the same dropout masks in both runs
        model(ids, torch.roll(ids, -1, dims=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def test_muon_updates_with_layer_and_op_swap_equal_the_run_without_swap():
    torch.manual_seed(0)
    plain = TinyDecoder(num_layers=NUM_LAYERS)
    swapped = copy.deepcopy(plain)
    plan = plan_activation_memory(
        swapped,
        None,
        None,
        validate_section(
            "swap",
            {
                "enable": True,
                "layer_swap": [{"layers": ["0-1"]}],
                "op_swap": [{"op_name": "mlp", "layers": ["2"]}],
            },
        ),
        NUM_LAYERS,
    )
    initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
    opt_plain, opt_swapped = _train(plain), _train(swapped)
    assert plan.swapper.swapped_bytes > 0  # swap really held activations
    routes = {g["route"] for g in opt_swapped.param_groups}
    assert routes == {"muon", "adamw"}  # both of Muon's branches are exercised
    for (name, a), b in zip(plain.named_parameters(), swapped.parameters()):
        assert not torch.equal(a, initial[name]), name  # the run did update
        assert torch.equal(a, b), name
    for a, b in zip(opt_plain.state.values(), opt_swapped.state.values()):
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key


def test_the_optimizer_key_swap_is_still_refused_with_the_original_message():
    # `optimizer.swap` is the original's Muon kwarg (parameter swap), not the activation section.
    with pytest.raises(ConfigError, match="optimizer.swap: Muon does not support swap."):
        build_optimizer(
            validate_section("optimizer", {**MUON, "swap": True}), TinyDecoder(num_layers=1), 1e-2
        )
