"""What build_scheduler refuses, and how it says so (the dotted key and what would be valid)."""

from __future__ import annotations

import pytest

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.lr import SCHEDULER_TYPES, build_scheduler

from .helpers import typed

ALL_TEN = {
    "ConstantWarmUpLR": {"warmup_steps": 5},
    "LinearWithWarmUpLR": {"warmup_ratio": 0.1},
    "CosineWithWarmUpLR": {"warmup_ratio": 0.1, "lr_end": 1e-6, "num_cycles": 0.5, "decay_steps": 90},
    "CosineWithRestartsAndWarmUpLR": {"warmup_ratio": 0.01, "num_cycles": 2.0},
    "PolynomialWithWarmUpLR": {"warmup_ratio": 0.01, "lr_end": 1e-7, "power": 1.0},
    "WarmUpStableDecayLR": {"warmup_steps": 10, "lr_end": 1e-7, "decay_start_ratio": 0.8},
    "CosineAnnealingLR": {"base_lr": 1e-5, "t_max": 100, "eta_min": 0.0},
    "ConstantWithCoolDownLR": {"warmup_steps": 5, "keep_steps": 10, "decay_steps": 50, "lr_end1": 1e-6},
    "CosineAnnealingWarmRestarts": {"base_lr": 1e-5, "t_0": 10, "t_mult": 2},
    "LearningRateWiseLayer": {
        "lr_scale": 0.5,
        "base_lr": {"type": "ConstantWarmUpLR", "learning_rate": 1e-4},
    },
}


def refused(section: dict, total: int = 100) -> str:
    with pytest.raises(ConfigError) as info:
        build_scheduler(typed(section), total)
    return str(info.value)


def test_all_ten_registered_types_build():
    assert set(ALL_TEN) == set(SCHEDULER_TYPES)
    for name, keys in ALL_TEN.items():
        schedule = build_scheduler(typed({"type": name, "learning_rate": 1e-5, **keys}), 100)
        assert schedule.type_name == name
        assert schedule.description.startswith(name)
        assert all(schedule.lr_at(t) >= 0 for t in range(0, 120))


def test_a_typo_is_refused_with_the_accepted_keys_and_a_suggestion():
    message = refused({"type": "CosineWithWarmUpLR", "warmup_ration": 0.01})
    assert "lr_scheduler.warmup_ration" in message
    assert "did you mean warmup_ratio?" in message
    assert "num_cycles" in message and "decay_ratio" in message  # lists what is accepted


def test_a_key_of_another_scheduler_says_whose_it_is():
    message = refused({"type": "CosineAnnealingLR", "base_lr": 1e-4, "t_max": 10, "warmup_steps": 5})
    assert "lr_scheduler.warmup_steps" in message
    assert "CosineAnnealingLR accepts: type, base_lr, t_max, eta_min" in message
    assert "ConstantWarmUpLR" in message


def test_null_keys_count_as_unset():
    schedule = build_scheduler(
        typed({"type": "CosineAnnealingLR", "base_lr": 1e-4, "t_max": 10, "warmup_steps": None}), 50
    )
    assert schedule.lr_at(0) == pytest.approx(1e-4)


def test_unknown_type_and_missing_type():
    message = refused({"type": "CosineWithWarmupLR"})
    assert "lr_scheduler.type" in message and "did you mean CosineWithWarmUpLR?" in message
    assert "lr_scheduler.type is required" in refused({"learning_rate": 1e-4})


def test_total_steps_in_yaml_must_equal_training_steps():
    section = {"type": "LinearWithWarmUpLR", "learning_rate": 1e-4, "total_steps": 500}
    message = refused(section, total=1000)
    assert "lr_scheduler.total_steps" in message and "training.steps is 1000" in message
    assert build_scheduler(typed(section), 500).lr_at(250) == pytest.approx(0.5e-4)


@pytest.mark.parametrize(
    "section, key, fragment",
    [
        (
            {"type": "ConstantWarmUpLR", "warmup_steps": -1},
            "lr_scheduler.warmup_steps",
            "must be >= 0, but got -1",
        ),
        ({"type": "ConstantWarmUpLR", "warmup_steps": 2.5}, "lr_scheduler.warmup_steps", "must be int"),
        ({"type": "ConstantWarmUpLR", "warmup_ratio": 1.5}, "lr_scheduler.warmup_ratio", "must be in [0,1]"),
        ({"type": "ConstantWarmUpLR", "warmup_ratio": "0.1"}, "lr_scheduler.warmup_ratio", "float or int"),
        ({"type": "ConstantWarmUpLR", "learning_rate": -1e-4}, "lr_scheduler.learning_rate", ">= 0"),
        ({"type": "ConstantWarmUpLR", "learning_rate": float("nan")}, "lr_scheduler.learning_rate", "finite"),
        # A number written as text ("1e-7") counts, as in every float key; other text does not.
        (
            {"type": "CosineWithWarmUpLR", "lr_end": "tiny"},
            "lr_scheduler.lr_end",
            "must be a learning rate, got 'tiny' (str)",
        ),
        ({"type": "ConstantWarmUpLR", "warmup_lr_init": -1.0}, "lr_scheduler.warmup_lr_init", ">= 0"),
        ({"type": "CosineWithWarmUpLR", "lr_end": float("inf")}, "lr_scheduler.lr_end", "finite"),
        ({"type": "CosineWithWarmUpLR", "lr_end": -1e-6}, "lr_scheduler.lr_end", ">= 0"),
        (
            {"type": "PolynomialWithWarmUpLR", "learning_rate": 1e-7, "lr_end": 1e-7},
            "lr_scheduler.lr_end",
            "must be smaller than initial lr",
        ),
        ({"type": "PolynomialWithWarmUpLR", "power": -1.0}, "lr_scheduler.power", ">= 0"),
        (
            {"type": "WarmUpStableDecayLR", "learning_rate": 1e-4},
            "lr_scheduler.decay_start_steps",
            "decay_start",
        ),
        (
            {"type": "WarmUpStableDecayLR", "learning_rate": 1e-4, "decay_start_ratio": 1.0},
            "lr_scheduler.decay_start_ratio",
            "not before training.steps",
        ),
        (
            {"type": "WarmUpStableDecayLR", "learning_rate": 1e-4, "decay_start_steps": 100},
            "lr_scheduler.decay_start_steps",
            "not before training.steps",
        ),
        (
            {"type": "WarmUpStableDecayLR", "lr_end": 1e-3, "decay_start_steps": 5},
            "lr_scheduler.lr_end",
            "smaller",
        ),
        ({"type": "ConstantWithCoolDownLR", "keep_steps": -3}, "lr_scheduler.keep_steps", ">= 0"),
        (
            {"type": "CosineAnnealingLR", "base_lr": 1e-4, "t_max": 0},
            "lr_scheduler.t_max",
            "positive integer T_max",
        ),
        ({"type": "CosineAnnealingLR", "t_max": 10}, "lr_scheduler.base_lr", "requires base_lr"),
        ({"type": "CosineAnnealingWarmRestarts", "base_lr": 1e-4}, "lr_scheduler.t_0", "requires t_0"),
        (
            {"type": "CosineAnnealingWarmRestarts", "base_lr": 1e-4, "t_0": 5, "t_mult": 1.5},
            "lr_scheduler.t_mult",
            "positive integer t_mult",
        ),
        ({"type": "LearningRateWiseLayer", "lr_scale": 0.5}, "lr_scheduler.base_lr", "nested lr_scheduler"),
        (
            {"type": "LearningRateWiseLayer", "base_lr": {"type": "ConstantWarmUpLR"}},
            "lr_scheduler.lr_scale",
            "requires lr_scale",
        ),
        (
            {
                "type": "LearningRateWiseLayer",
                "lr_scale": 2.0,
                "base_lr": {"type": "ConstantWarmUpLR", "warmup": 3},
            },
            "lr_scheduler.base_lr.warmup",
            "ConstantWarmUpLR accepts",
        ),
    ],
)
def test_refusals_name_the_dotted_key(section, key, fragment):
    message = refused(section)
    assert key in message
    assert fragment in message


def test_training_steps_must_be_a_whole_number():
    with pytest.raises(ConfigError, match="training.steps"):
        build_scheduler(typed({"type": "ConstantWarmUpLR"}), -5)


def test_settings_without_effect_are_warned_about():
    schedule = build_scheduler(
        typed({"type": "CosineAnnealingLR", "learning_rate": 3e-4, "base_lr": 1e-4, "t_max": 10}), 20
    )
    assert any("lr_scheduler.learning_rate" in w and "no effect" in w for w in schedule.warnings)
    schedule = build_scheduler(typed({"type": "ConstantWarmUpLR", "warmup_steps": 30}), 20)
    assert any("longer than training.steps" in w for w in schedule.warnings)


def test_a_learning_rate_of_zero_everywhere_is_warned_about():
    # The article's first troubleshooting row: the loss does not move because the lr is 0.
    flat = build_scheduler(typed({"type": "ConstantWarmUpLR", "learning_rate": 0.0, "warmup_steps": 0}), 20)
    assert any("learning rate is 0 at every step" in w for w in flat.warnings)
    warm = build_scheduler(typed({"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 5}), 20)
    assert not any("learning rate is 0" in w for w in warm.warnings)


def test_load_config_types_the_section_against_training_steps(base_config):
    # lr_scheduler is typed at load (lmforge.lr.schema): every check, the training.steps ones included.
    from lmforge.config import load_config

    base_config["training"]["steps"] = 10
    base_config["lr_scheduler"] = {
        "type": "WarmUpStableDecayLR",
        "learning_rate": 1e-4,
        "decay_start_steps": 5,
    }
    cfg = load_config(base_config)
    assert cfg.lr_scheduler.typed.decay_start_steps == 5
    assert build_scheduler(cfg.lr_scheduler, cfg.training.steps).decay_start == 5
    base_config["lr_scheduler"]["decay_start_steps"] = 5000
    with pytest.raises(ConfigError, match="lr_scheduler.decay_start_steps"):
        load_config(base_config)
    base_config["lr_scheduler"] = {"type": "ConstantWarmUpLR", "warmup_ration": 0.1}
    with pytest.raises(ConfigError, match=r"lr_scheduler.warmup_ration \(did you mean warmup_ratio\?\)"):
        load_config(base_config)
    base_config["lr_scheduler"] = {"type": "ConstantWarmUpLR", "total_steps": 5}
    with pytest.raises(ConfigError, match="training.steps is 10"):
        load_config(base_config)


def test_pydantic_section_with_a_nested_mapping_builds():
    config = pytest.importorskip("lmforge.config")
    section = config.LrSchedulerConfig.model_validate(
        {
            "type": "LearningRateWiseLayer",
            "lr_scale": 0.5,
            "base_lr": {"type": "WarmUpStableDecayLR", "learning_rate": 1e-3, "decay_start_ratio": 0.5},
        }
    )
    schedule = build_scheduler(typed(section), 10)
    assert schedule.lr_at(0) == pytest.approx(0.5e-3)
    assert schedule.lr_at(10) == pytest.approx(0.5 * 1e-7)


@pytest.mark.parametrize("cycles", [0.5, 0.0, 0.999])
def test_restarts_need_at_least_one_cycle(cycles):
    # The spec: num_cycles (the number of restarts) >= 1.
    message = refused({"type": "CosineWithRestartsAndWarmUpLR", "num_cycles": cycles})
    assert "lr_scheduler.num_cycles" in message and ">= 1" in message
    build_scheduler(typed({"type": "CosineWithRestartsAndWarmUpLR", "num_cycles": 1}), 100)


@pytest.mark.parametrize("wrong", [{"type": "ConstantWarmUpLR"}, None, "CosineWithWarmUpLR"])
def test_build_scheduler_takes_only_the_typed_section(wrong):
    # A mapping is validated by the config (validate_section / load_config), once; never by the builder.
    with pytest.raises(
        TypeError, match=r"build_scheduler takes the typed lr_scheduler section .*validate_section"
    ):
        build_scheduler(wrong, 10)


def test_the_typed_section_carries_its_keys_and_resolves_per_total():
    # Validated on its own (no training.steps yet), the section is typed: its keys are attributes, and
    # what depends on the total (ratios, the WSD decay start) is resolved for each total asked.
    section = typed(
        {"type": "WarmUpStableDecayLR", "learning_rate": 1e-3, "warmup_ratio": 0.1, "decay_start_ratio": 0.5}
    )
    spec = section.typed
    assert (spec.learning_rate, spec.warmup_ratio, spec.decay_start_ratio, spec.warmup_steps) == (
        1e-3,
        0.1,
        0.5,
        None,
    )
    for total in (10, 100, 1000):
        schedule = build_scheduler(section, total)
        assert (schedule.warmup_steps, schedule.decay_start, schedule.total_steps) == (
            total // 10,
            total // 2,
            total,
        )
        assert spec.schedule(total) == schedule
    # A total the settings cannot work with is refused when the schedule is asked for, naming the key.
    short = typed({"type": "WarmUpStableDecayLR", "learning_rate": 1e-3, "decay_start_steps": 50})
    assert build_scheduler(short, 51).decay_start == 50
    with pytest.raises(
        ConfigError, match=r"lr_scheduler\.decay_start_steps: the decay would start at step 50"
    ):
        build_scheduler(short, 50)


def test_every_problem_of_the_section_is_named_at_once():
    message = refused(
        {"type": "CosineWithWarmUpLR", "warmup_ration": 0.1, "warmup_steps": -1, "lr_end": "low"}
    )
    assert "3 problems" in message
    assert "lr_scheduler.warmup_ration (did you mean warmup_ratio?)" in message
    assert "lr_scheduler.warmup_steps: The warmup_step must be >= 0, but got -1" in message
    assert "lr_scheduler.lr_end: must be a learning rate, got 'low' (str)" in message


def test_a_number_written_as_text_is_a_number_in_every_scheduler_key() -> None:
    # The scheduler's schema owns learning_rate too (the config section declares only type).
    typed_spec = validate_section(
        "lr_scheduler", {"type": "CosineWithWarmUpLR", "learning_rate": "3e-4", "lr_end": "1e-7"}
    ).typed
    assert (typed_spec.learning_rate, typed_spec.lr_end) == (3e-4, 1e-7)
    assert validate_section("lr_scheduler", {"type": "ConstantWarmUpLR"}).typed.learning_rate == 1e-5
