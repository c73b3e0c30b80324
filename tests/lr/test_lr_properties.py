"""Properties over random settings.

Any settings: either a ConfigError at build time, or a finite, non-negative lr at every step.
Valid settings: always build, and the lr stays between the smallest and largest lr in the settings.
"""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lmforge.errors import ConfigError
from lmforge.lr import SCHEDULER_TYPES, build_scheduler

from .helpers import typed

odd = st.sampled_from([math.nan, math.inf, -math.inf, True, "1e-5"])
any_steps = st.one_of(st.none(), st.integers(-3, 300), st.just(2.5))
any_ratio = st.one_of(st.none(), st.floats(-0.5, 1.5), odd)
any_rate = st.one_of(st.none(), st.floats(-1e-3, 1e-2), st.just(0.0), odd)
any_small = st.one_of(st.none(), st.floats(-2.0, 4.0), st.integers(-2, 4), odd)

ANY_VALUE = {
    "learning_rate": any_rate,
    "warmup_steps": any_steps,
    "warmup_ratio": any_ratio,
    "warmup_lr_init": any_rate,
    "lr_end": any_rate,
    "num_cycles": any_small,
    "power": any_small,
    "decay_steps": any_steps,
    "decay_ratio": any_ratio,
    "decay_start_steps": any_steps,
    "decay_start_ratio": any_ratio,
    "keep_steps": any_steps,
    "final_steps": any_steps,
    "lr_end1": any_rate,
    "lr_end2": any_rate,
    "base_lr": any_rate,
    "t_max": any_steps,
    "t_0": any_steps,
    "t_mult": st.one_of(st.none(), st.integers(-1, 4)),
    "eta_min": any_rate,
}

steps = st.integers(0, 300)
ratio = st.floats(0.0, 1.0)
rate = st.one_of(st.floats(0.0, 1e-2), st.just(0.0))
positive = st.integers(1, 60)

VALID_VALUE = {
    "learning_rate": rate,
    "warmup_steps": steps,
    "warmup_ratio": ratio,
    "warmup_lr_init": rate,
    "lr_end": rate,
    "num_cycles": st.floats(0.0, 4.0),
    "power": st.floats(0.0, 4.0),
    "decay_steps": steps,
    "decay_ratio": ratio,
    "decay_start_steps": steps,
    "decay_start_ratio": ratio,
    "keep_steps": steps,
    "final_steps": steps,
    "lr_end1": rate,
    "lr_end2": rate,
    "base_lr": rate,
    "t_max": positive,
    "t_0": positive,
    "t_mult": st.integers(1, 4),
    "eta_min": rate,
}
REQUIRED = {"CosineAnnealingLR": {"base_lr", "t_max"}, "CosineAnnealingWarmRestarts": {"base_lr", "t_0"}}


@st.composite
def sections(draw, type_name: str, values: dict, required: frozenset = frozenset()) -> dict:
    section = {"type": type_name}
    for key in SCHEDULER_TYPES[type_name].accepted_keys():
        if key in values and (key in required or draw(st.booleans())):
            section[key] = draw(values[key])
    return section


def _probe_steps(total: int) -> set[int]:
    return {0, 1, total // 3, total // 2, max(0, total - 1), total, total + 1, 2 * total + 5}


@settings(max_examples=300, deadline=None)
@given(
    st.data(), st.sampled_from(sorted(set(SCHEDULER_TYPES) - {"LearningRateWiseLayer"})), st.integers(0, 200)
)
def test_any_settings_are_refused_or_give_a_finite_non_negative_lr(data, type_name, total):
    section = data.draw(sections(type_name, ANY_VALUE))
    try:
        schedule = build_scheduler(typed(section), total)
    except ConfigError:
        return
    for t in _probe_steps(total):
        lr = schedule.lr_at(t)
        assert math.isfinite(lr) and lr >= 0.0, (t, lr)


@settings(max_examples=300, deadline=None)
@given(
    st.data(), st.sampled_from(sorted(set(SCHEDULER_TYPES) - {"LearningRateWiseLayer"})), st.integers(1, 200)
)
def test_valid_settings_build_and_stay_within_their_lrs(data, type_name, total):
    section = data.draw(sections(type_name, VALID_VALUE, frozenset(REQUIRED.get(type_name, ()))))
    if type_name == "CosineWithRestartsAndWarmUpLR" and "num_cycles" in section:
        section["num_cycles"] = 1.0 + section["num_cycles"]  # the spec: at least one cycle
    base = section.get("learning_rate", 1e-5)
    if type_name in ("PolynomialWithWarmUpLR", "WarmUpStableDecayLR"):
        assume(base > section.get("lr_end", 1e-7))
    if type_name == "WarmUpStableDecayLR":
        if "decay_start_ratio" in section:
            assume(int(section["decay_start_ratio"] * total + 1e-6) < total)
        else:
            section["decay_start_steps"] = data.draw(st.integers(0, total - 1))
    schedule = build_scheduler(typed(section), total)
    lrs = [
        v for k, v in section.items() if k in ("learning_rate", "base_lr", "warmup_lr_init") or "lr_end" in k
    ]
    lrs += [v for k, v in section.items() if k == "eta_min"]
    if "learning_rate" not in section and type_name not in REQUIRED:
        lrs.append(1e-5)
    for default in ("lr_end", "lr_end1"):  # defaults that can be reached without being written
        if default in SCHEDULER_TYPES[type_name].accepted_keys() and default not in section:
            lrs.append(1e-7 if type_name in ("PolynomialWithWarmUpLR", "WarmUpStableDecayLR") else 0.0)
    low, high = min([*lrs, 0.0]), max(lrs)
    for t in _probe_steps(total):
        lr = schedule.lr_at(t)
        assert math.isfinite(lr)
        assert low - 1e-15 <= lr <= high * (1 + 1e-12) + 1e-18, (t, lr, section)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(sorted(SCHEDULER_TYPES)), st.text(min_size=1, max_size=12))
def test_an_unknown_key_is_always_refused(type_name, key):
    accepted = {"type", "total_steps", *SCHEDULER_TYPES[type_name].accepted_keys()}
    assume(key not in accepted)
    section = {"type": type_name, "base_lr": 1e-3, "t_max": 5, "t_0": 5, "lr_scale": 1.0}
    if type_name == "LearningRateWiseLayer":
        section["base_lr"] = {"type": "ConstantWarmUpLR"}
    section = {k: v for k, v in section.items() if k in accepted}
    section[key] = 1
    try:
        build_scheduler(typed(section), 10)
    except ConfigError as error:
        assert f"lr_scheduler.{key}" in str(error)
    else:
        raise AssertionError(f"{key!r} was accepted by {type_name}")
