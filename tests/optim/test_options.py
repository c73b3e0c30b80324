"""The optimizer section: defaults, validation and the original's error texts."""

from __future__ import annotations

import logging
import typing
from pathlib import Path

import pytest
import yaml

from lmforge.config import validate_section
from lmforge.config.schema import OptimizerConfig
from lmforge.errors import ConfigError
from lmforge.optim import build_optimizer, validate_optimizer
from lmforge.optim.specs import OPTIMIZER_TYPES, AdamWSpec, LAMBSpec, LionSpec, MuonSpec

from .optim_helpers import TinyLM

SPEC_YAMLS = Path(__file__).resolve().parents[1] / "fixtures" / "spec_yamls"


def _err(section: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        validate_optimizer(section)
    return str(exc.value)


@pytest.mark.parametrize(
    ("section", "key", "text"),
    [
        ({"type": "SGD"}, "optimizer.type", "Optimizer type SGD is not implemented yet."),
        ({"eps": -1.0}, "optimizer.eps", "Invalid epsilon value: -1.0, should be >= 0."),
        (
            {"betas": [0.9, 1.0]},
            "optimizer.betas",
            "Invalid beta parameter at index 1: 1.0, should be >= 0 and < 1.",
        ),
        (
            {"betas": [-0.1, 0.9]},
            "optimizer.betas",
            "Invalid beta parameter at index 0: -0.1, should be >= 0 and < 1.",
        ),
        (
            {"weight_decay": -0.5},
            "optimizer.weight_decay",
            "Invalid weight_decay value: -0.5, should be >= 0.",
        ),
        (
            {"weight_decay_exclude": "norm"},
            "optimizer.weight_decay_exclude",
            "should be a list of strings, but got str.",
        ),
        (
            {"weight_decay_include": [1]},
            "optimizer.weight_decay_include",
            "All items in weight_decay_include should be strings",
        ),
        ({"type": "Muon", "swap": True}, "optimizer.swap", "Muon does not support swap."),
        (
            {"type": "Muon", "comm_strategy": "p2p"},
            "optimizer.comm_strategy",
            "comm_strategy must be 'allgather' or 'allgather_deredundency', got 'p2p'.",
        ),
        (
            {"type": "Muon", "ns_coefficients": []},
            "optimizer.ns_coefficients",
            "ns_coefficients must be a non-empty list/tuple",
        ),
        (
            {"type": "Muon", "ns_coefficients": [1.0, 2.0]},
            "optimizer.ns_coefficients",
            "flat ns_coefficients must have 3 elements",
        ),
        ({"type": "Muon", "ns_steps": 0}, "optimizer.ns_steps", "ns_steps must be positive, got 0"),
        (
            {"type": "Muon", "ns_coefficients": [[[1.0, 2.0, 3.0]]]},
            "optimizer.ns_coefficients",
            "segmented ns_coefficients entry 0 must be [[a, b, c], count]",
        ),
        (
            {"type": "Muon", "ns_coefficients": [[[1.0, 2.0], 3]]},
            "optimizer.ns_coefficients",
            "segmented ns_coefficients entry 0 must hold a 3-element triple",
        ),
        (
            {"type": "Muon", "ns_coefficients": [[[1.0, 2.0, 3.0], 0]]},
            "optimizer.ns_coefficients",
            "segmented ns_coefficients entry 0 count must be positive",
        ),
        (
            {"type": "Muon", "qk_clip_threshold": 0},
            "optimizer.qk_clip_threshold",
            "qk_clip_threshold must be positive, got 0.0",
        ),
        (
            {"type": "Muon", "adamw_include": [3]},
            "optimizer.adamw_include",
            "adamw_include must be a list of glob strings.",
        ),
        ({"lr_scale": {"*emb*": 0}}, "optimizer.lr_scale", "must be > 0"),
        ({"lr_scale": ["*emb*"]}, "optimizer.lr_scale", "expected a mapping"),
        ({"eps": "tiny"}, "optimizer.eps", "expected a number"),
    ],
)
def test_errors_name_the_key_and_carry_the_original_text(section, key, text):
    msg = _err(section)
    assert msg.startswith(key)
    assert text in msg


def test_qk_clip_threshold_is_only_checked_when_enabled():
    validate_optimizer({"type": "Muon", "qk_clip_enabled": False, "qk_clip_threshold": 0})


def test_muon_defaults_are_muons_own_when_the_yaml_omits_them():
    # Through the pydantic schema, which fills AdamW-oriented defaults (eps 1e-8, weight_decay 0.01).
    opts = validate_section("optimizer", {"type": "Muon"}).typed
    assert opts.grouping.weight_decay == 0.1
    assert opts.hyper.eps == 1e-7
    assert opts.hyper.adamw_betas == (0.95, 0.95)
    assert opts.hyper.adamw_eps == 1e-8
    assert opts.hyper.momentum == 0.95 and opts.hyper.nesterov is True
    assert opts.hyper.matched_adamw_rms == 0.2
    assert opts.hyper.ns_schedule == ((3.4445, -4.7750, 2.0315),) * 5
    assert opts.hyper.qk_clip_enabled is True and opts.hyper.qk_clip_threshold == 100.0
    assert opts.hyper.comm_strategy == "allgather"
    assert opts.hyper.adamw_include == ["*word_embeddings*", "*output_layer*"]
    # A key the YAML sets is honoured (eps is Newton-Schulz's eps for Muon, as in the original).
    opts = validate_section("optimizer", {"type": "Muon", "eps": 1e-6, "weight_decay": 0.0}).typed
    assert opts.hyper.eps == 1e-6 and opts.grouping.weight_decay == 0.0


def test_adamw_defaults_are_the_spec_table():
    opts = validate_section("optimizer", {}).typed
    assert opts.type == "AdamW"
    assert opts.hyper.betas == (0.9, 0.95) and opts.hyper.eps == 1e-8
    assert opts.grouping.weight_decay == 0.01
    # An int weight decay is a number (the original's float-only check is not copied).
    assert validate_optimizer({"weight_decay": 0}).grouping.weight_decay == 0.0


def test_segmented_schedule_ignores_ns_steps():
    opts = validate_optimizer(
        {
            "type": "Muon",
            "ns_steps": 3,
            "ns_coefficients": [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]],
        },
    )
    assert opts.hyper.ns_steps == 10
    assert opts.hyper.ns_schedule[7] == (3.4445, -4.7750, 2.0315)
    assert opts.hyper.ns_schedule[8:] == ((2.0, -1.5, 0.5),) * 2


def test_unused_keys_warn_instead_of_vanishing(caplog):
    logger = logging.getLogger("lmforge")
    logger.propagate = True
    caplog.set_level(logging.WARNING, logger="lmforge")
    opts = validate_optimizer({"type": "Muon", "betas": [0.9, 0.99], "bogus": 1})
    assert opts.ignored_keys == ["betas", "bogus"]
    text = caplog.text
    assert "optimizer.betas" in text and "adamw_betas" in text and "optimizer.bogus" in text


def test_swap_is_refused_by_muon_and_unused_elsewhere(caplog):
    logging.getLogger("lmforge").propagate = True
    caplog.set_level(logging.WARNING, logger="lmforge")
    assert validate_optimizer({"type": "AdamW", "swap": True}).ignored_keys == ["swap"]
    assert "optimizer.swap is not used by the AdamW optimizer" in caplog.text
    assert validate_optimizer({"type": "Muon", "swap": False}).ignored_keys == []


def test_enable_cpu_offload_is_the_offload_switch():
    assert validate_optimizer({"enable_cpu_offload": True}).hyper.offload_states is True
    assert _err({"type": "Muon", "offload_states": True}).startswith("optimizer.offload_states")


def test_muon_without_model_names_the_original_error():
    with pytest.raises(ConfigError, match="Model must be provided for Muon optimizer."):
        build_optimizer(validate_section("optimizer", {"type": "Muon"}), None, 0.02)


RECIPES = [
    p for p in sorted(SPEC_YAMLS.glob("*.yaml")) if "optimizer" in (yaml.safe_load(p.read_text()) or {})
]


def test_the_spec_recipes_are_found():
    assert len(RECIPES) >= 7


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_spec_recipe_builds(path):
    section = yaml.safe_load(path.read_text())["optimizer"]
    for form in (section, OptimizerConfig.model_validate(section)):
        opt = build_optimizer(validate_section("optimizer", form), TinyLM(), 1e-3)
        assert type(opt).__name__ == section.get("type", "AdamW")
        assert sum(len(g["params"]) for g in opt.param_groups) == len(list(TinyLM().parameters()))


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"type": "AdamW", "use_fused": False}, "optimizer.use_fused"),
        ({"type": "AdamW", "enable_fused_opt": True}, "optimizer.enable_fused_opt"),
        ({"type": "Muon", "use_fused_adamw": True}, "optimizer.use_fused_adamw"),
    ],
)
def test_kernel_choices_of_the_original_warn_that_they_have_no_effect(caplog, section, key):
    caplog.set_level(logging.WARNING, logger="lmforge")
    validate_optimizer(section)
    assert f"{key} = " in caplog.text and "has no effect" in caplog.text


def test_hyper_is_the_schema_of_the_type():
    # One pydantic schema per type, chosen by ``type``; each carries its own published defaults:
    # Lion betas (0.9, 0.99) (Chen et al. 2023), LAMB betas (0.9, 0.999) and eps 1e-6 (You et al. 2020).
    kinds = {"AdamW": AdamWSpec, "Muon": MuonSpec, "Lion": LionSpec, "LAMB": LAMBSpec}
    for name, cls in kinds.items():
        assert type(validate_section("optimizer", {"type": name}).typed.hyper) is cls
    assert validate_optimizer({"type": "Lion"}).hyper.betas == (0.9, 0.99)
    lamb = validate_optimizer({"type": "LAMB"}).hyper
    assert lamb.betas == (0.9, 0.999) and lamb.eps == 1e-6


@pytest.mark.parametrize(
    ("section", "start"),
    [
        ({"betas": ["a", 0.9]}, "optimizer.betas[0]: expected a number"),
        ({"lr_scale": {"*emb*": "x"}}, "optimizer.lr_scale.*emb*: expected a number"),
        ({"weight_decay_values": {"*emb*": -1}}, "optimizer.weight_decay_values.*emb*: Invalid weight_decay"),
        ({"type": "Lion", "moment_dtype": "bfloat16"}, "optimizer.moment_dtype: compressed (bf16) moments"),
        ({"type": "Muon", "momentum": 1.0}, "optimizer.momentum: must be >= 0 and < 1"),
        ({"type": "Muon", "ns_steps": 2.5}, "optimizer.ns_steps: expected an integer"),
    ],
)
def test_a_problem_inside_a_key_names_its_dotted_path(section, start):
    assert _err(section).startswith(start)


def test_every_problem_is_reported_at_once():
    msg = _err({"eps": -1.0, "weight_decay": -0.5})
    assert msg.startswith("optimizer has 2 problems:")
    assert (
        "optimizer.eps: Invalid epsilon value" in msg
        and "optimizer.weight_decay: Invalid weight_decay" in msg
    )


def test_only_written_keys_count_as_given(caplog):
    # Through the section schema, whose fields (betas, eps, ...) have AdamW defaults: for Muon those
    # defaults are not "written", so nothing is warned about and Muon's own defaults apply.
    logging.getLogger("lmforge").propagate = True
    caplog.set_level(logging.WARNING, logger="lmforge")
    opts = validate_section("optimizer", {"type": "Muon"}).typed
    assert opts.ignored_keys == [] and "optimizer.betas" not in caplog.text
    written = validate_section("optimizer", {"type": "Muon", "betas": [0.9, 0.99]}).typed
    assert written.ignored_keys == ["betas"] and "optimizer.betas is not used by the Muon" in caplog.text


def test_each_type_name_is_its_schema_discriminator():
    for name, cls in OPTIMIZER_TYPES.items():
        assert typing.get_args(cls.model_fields["type"].annotation) == (name,)
