"""Every scheduler against closed forms written out here (reference: mindformers.md §3.3).

Each test checks step 0, the end of warm-up, mid-decay, the end and past the end.
"""

from __future__ import annotations

import math

import pytest

from lmforge.lr import build_scheduler

from .helpers import typed

T = 100  # training.steps


def lr(section: dict, step: int, total: int = T) -> float:
    return build_scheduler(typed(section), total).lr_at(step)


def approx(x: float) -> pytest.approx:
    return pytest.approx(x, rel=1e-12, abs=1e-18)


def test_constant_warmup():
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 10, "warmup_lr_init": 1e-4}
    assert lr(sec, 0) == approx(1e-4)
    assert lr(sec, 4) == approx(1e-4 + (1e-3 - 1e-4) * 4 / 10)
    assert lr(sec, 10) == approx(1e-3)
    assert lr(sec, 50) == approx(1e-3)
    assert lr(sec, T) == approx(1e-3)
    assert lr(sec, 10 * T) == approx(1e-3)


def test_constant_without_warmup_keys_is_constant():
    # The original needs warmup_steps or warmup_ratio here; lmforge reads "no warm-up".
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 2e-4}
    assert [lr(sec, t) for t in (0, 1, T)] == [approx(2e-4)] * 3


def test_linear_warmup():
    sec = {"type": "LinearWithWarmUpLR", "learning_rate": 1e-3, "warmup_ratio": 0.2}
    warm = 20
    assert lr(sec, 0) == 0.0
    assert lr(sec, 10) == approx(1e-3 * 10 / warm)
    assert lr(sec, warm) == approx(1e-3)
    assert lr(sec, 60) == approx(1e-3 * (T - 60) / (T - warm))
    assert lr(sec, T) == 0.0
    assert lr(sec, T + 7) == 0.0


def test_cosine_warmup_with_lr_end_and_cycles():
    base, end, warm = 1e-3, 1e-5, 10
    sec = {
        "type": "CosineWithWarmUpLR",
        "learning_rate": base,
        "warmup_steps": warm,
        "lr_end": end,
        "num_cycles": 0.5,
    }

    def closed(t):
        p = (t - warm) / (T - warm)
        return end + (base - end) * 0.5 * (1 + math.cos(math.pi * 2 * 0.5 * p))

    assert lr(sec, 0) == 0.0
    assert lr(sec, 5) == approx(base * 5 / warm)
    assert lr(sec, warm) == approx(base)
    assert lr(sec, 55) == approx(closed(55))
    assert lr(sec, 55) == approx(end + (base - end) * 0.5)  # the midpoint of a half cycle
    assert lr(sec, T - 1) == approx(closed(T - 1))
    assert lr(sec, T) == approx(end)
    assert lr(sec, T + 30) == approx(end)


def test_cosine_ends_at_decay_steps_and_decay_ratio_wins():
    # lmforge's fix of the original (which measured the cosine over total - warmup = 100 steps and
    # cut it at decay_steps): the cosine spans warm-up end .. decay_steps, then lr_end is held.
    base, end = 1e-3, 1e-6
    sec = {"type": "CosineWithWarmUpLR", "learning_rate": base, "decay_steps": 90, "lr_end": end}
    assert lr(sec, 0) == approx(base)
    assert lr(sec, 45) == approx(end + (base - end) * 0.5)  # the midpoint of the 90-step cosine
    assert lr(sec, 89) == approx(end + (base - end) * 0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert lr(sec, 90) == approx(end)
    assert lr(sec, T) == approx(end)
    # No jump at decay_steps: the last cosine step is already within 0.04 % of lr_end's distance.
    assert lr(sec, 89) - end < 4e-4 * (base - end)
    ratio = {**sec, "decay_ratio": 0.5, "warmup_steps": 10}
    assert lr(ratio, 30) == approx(end + (base - end) * 0.5)  # midpoint of warm-up end 10 .. 50
    assert lr(ratio, 49) == approx(end + (base - end) * 0.5 * (1 + math.cos(math.pi * 39 / 40)))
    assert lr(ratio, 50) == approx(end)


def test_cosine_warmup_longer_than_decay_steps_warns():
    sec = {"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 60, "decay_steps": 50}
    schedule = build_scheduler(typed(sec), T)
    assert any("longer than the decay (50 steps" in w for w in schedule.warnings)
    assert schedule.lr_at(49) < 1e-3 and schedule.lr_at(50) == 0.0
    fine = build_scheduler(typed({**sec, "warmup_steps": 10}), T)
    assert not any("longer than the decay" in w for w in fine.warnings)


def test_cosine_with_restarts():
    base, warm, cycles = 1e-3, 20, 2.0
    sec = {
        "type": "CosineWithRestartsAndWarmUpLR",
        "learning_rate": base,
        "warmup_steps": warm,
        "num_cycles": cycles,
    }

    def closed(t):
        p = (t - warm) / (T - warm)
        return base * 0.5 * (1 + math.cos(math.pi * ((cycles * p) % 1.0)))

    assert lr(sec, 0) == 0.0
    assert lr(sec, warm) == approx(base)
    assert lr(sec, 40) == approx(base * 0.5)  # half of the first cycle (of 40 steps)
    assert lr(sec, 59) == approx(closed(59))
    assert lr(sec, 60) == approx(base)  # the restart
    assert lr(sec, 80) == approx(closed(80))
    assert lr(sec, T) == 0.0
    assert lr(sec, T + 1) == 0.0


def test_restarts_past_the_end_give_lr_end_not_zero():
    # decay_steps beyond training.steps: the original returns 0 between T and decay_steps.
    sec = {"type": "CosineWithRestartsAndWarmUpLR", "learning_rate": 1e-3, "lr_end": 1e-5, "decay_steps": 150}
    assert lr(sec, 120) == approx(1e-5)
    assert lr(sec, 200) == approx(1e-5)


def test_polynomial():
    base, end, warm, power = 1e-3, 1e-6, 10, 2.0
    sec = {
        "type": "PolynomialWithWarmUpLR",
        "learning_rate": base,
        "warmup_steps": warm,
        "lr_end": end,
        "power": power,
    }

    def closed(t):
        return (base - end) * (1 - (t - warm) / (T - warm)) ** power + end

    assert lr(sec, 0) == 0.0
    assert lr(sec, warm) == approx(base)
    assert lr(sec, 40) == approx(closed(40))
    assert lr(sec, T) == approx(end)
    assert lr(sec, T + 1) == approx(end)


def test_polynomial_clamps_at_lr_end_when_decay_is_shorter():
    # decay_steps 50 < T - W: the original's base goes negative past step 50 (NaN for power 0.5).
    base, end = 1e-3, 1e-6
    sec = {
        "type": "PolynomialWithWarmUpLR",
        "learning_rate": base,
        "lr_end": end,
        "power": 0.5,
        "decay_steps": 50,
    }
    assert lr(sec, 25) == approx((base - end) * (1 - 25 / 50) ** 0.5 + end)
    for t in (50, 51, 80, T, T + 5):
        assert lr(sec, t) == approx(end)


def test_wsd():
    base, end, warm = 1e-3, 1e-5, 10
    sec = {
        "type": "WarmUpStableDecayLR",
        "learning_rate": base,
        "warmup_steps": warm,
        "lr_end": end,
        "decay_start_ratio": 0.8,
    }
    start = 80
    assert lr(sec, 0) == 0.0
    assert lr(sec, warm) == approx(base)
    assert lr(sec, 79) == approx(base)
    assert lr(sec, 80) == approx(base)
    assert lr(sec, 90) == approx(base - (base - end) * (90 - start) / (T - start))
    assert lr(sec, T) == approx(end)
    assert lr(sec, T + 50) == approx(end)  # clamped; the original keeps going down (below 0)
    assert build_scheduler(typed(sec), T).boundaries() == {
        "warm-up end": warm,
        "decay start": start,
        "decay end": T,
    }


def test_wsd_step_zero_without_warmup_is_the_base_lr():
    # The original computes base·t/t: 0/0 at step 0.
    sec = {"type": "WarmUpStableDecayLR", "learning_rate": 3e-4, "decay_start_steps": 60}
    assert lr(sec, 0) == approx(3e-4)
    assert lr(sec, 1) == approx(3e-4)


def test_constant_with_cooldown():
    base, end1, end2 = 1e-3, 1e-4, 1e-5
    warm, keep, decay, final = 10, 20, 40, 10
    sec = {
        "type": "ConstantWithCoolDownLR",
        "learning_rate": base,
        "warmup_steps": warm,
        "keep_steps": keep,
        "decay_steps": decay,
        "final_steps": final,
        "lr_end1": end1,
        "lr_end2": end2,
    }
    assert lr(sec, 0) == 0.0
    assert lr(sec, 5) == approx(base / 2)
    assert lr(sec, warm) == approx(base)
    assert lr(sec, warm + keep - 1) == approx(base)
    t = warm + keep + 10
    assert lr(sec, t) == approx(end1 + (base - end1) * 0.5 * (1 + math.cos(math.pi * 2 * 0.5 * 10 / decay)))
    assert lr(sec, warm + keep + decay) == approx(end1)
    assert lr(sec, warm + keep + decay + final - 1) == approx(end1)
    assert lr(sec, warm + keep + decay + final) == approx(end2)
    assert lr(sec, T + 10) == approx(end2)


def test_cooldown_lr_end2_unset_means_lr_end1_but_zero_means_zero():
    sec = {"type": "ConstantWithCoolDownLR", "learning_rate": 1e-3, "decay_steps": 10, "lr_end1": 1e-4}
    assert lr(sec, 50) == approx(1e-4)
    assert lr({**sec, "lr_end2": 0.0}, 50) == 0.0


def test_cooldown_default_decay_runs_over_total_steps():
    # decay_steps defaults to total_steps (not total - warm-up - keep), as in the original.
    sec = {"type": "ConstantWithCoolDownLR", "learning_rate": 1e-3, "warmup_steps": 10, "lr_end1": 0.0}
    assert lr(sec, 10 + 50) == approx(1e-3 * 0.5)


def test_cosine_annealing():
    base, eta, tmax = 1e-3, 1e-5, 40
    sec = {"type": "CosineAnnealingLR", "base_lr": base, "t_max": tmax, "eta_min": eta}

    def closed(t):
        return eta + (base - eta) * (1 + math.cos(math.pi * t / tmax)) / 2

    assert lr(sec, 0) == approx(base)
    assert lr(sec, 20) == approx((base + eta) / 2)
    assert lr(sec, tmax) == approx(eta)
    assert lr(sec, 60) == approx(closed(60))  # periodic past t_max, like torch's
    assert lr(sec, 2 * tmax) == approx(base)


def test_cosine_annealing_warm_restarts():
    base, eta = 1e-3, 0.0
    sec = {"type": "CosineAnnealingWarmRestarts", "base_lr": base, "t_0": 10, "t_mult": 2, "eta_min": eta}
    # Cycles: [0, 10), [10, 30), [30, 70), [70, 150)
    assert lr(sec, 0) == approx(base)
    assert lr(sec, 5) == approx(base * 0.5)
    assert lr(sec, 10) == approx(base)
    assert lr(sec, 20) == approx(base * 0.5)
    assert lr(sec, 30) == approx(base)
    assert lr(sec, 45) == approx(base * (1 + math.cos(math.pi * 15 / 40)) / 2)
    assert lr(sec, 70) == approx(base)
    assert lr(sec, T) == approx(base * (1 + math.cos(math.pi * 30 / 80)) / 2)
    assert build_scheduler(typed(sec), T).boundaries() == {"restart 1": 10, "restart 2": 30, "restart 3": 70}
    flat = {**sec, "t_mult": 1}
    assert lr(flat, 25) == approx(base * 0.5)
    assert lr(flat, T) == approx(base)


def test_learning_rate_wise_layer_scales_the_nested_schedule():
    inner = {"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 10}
    sec = {"type": "LearningRateWiseLayer", "lr_scale": 0.25, "base_lr": inner}
    schedule = build_scheduler(typed(sec), T)
    reference = build_scheduler(typed(inner), T)
    for t in (0, 5, 10, 55, T, T + 3):
        assert schedule.lr_at(t) == approx(0.25 * reference.lr_at(t))
    assert schedule.base_lr == approx(0.25e-3)
    assert schedule.boundaries() == {"warm-up end": 10, "lr_end from": T}


def test_warmup_ratio_wins_and_is_the_floor_of_ratio_times_total():
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 1.0, "warmup_ratio": 0.05, "warmup_steps": 50}
    schedule = build_scheduler(typed(sec), 130)  # 0.05 × 130 = 6.5 -> 6
    assert schedule.boundaries()["warm-up end"] == 6
    assert schedule.lr_at(3) == approx(3 / 6)
    assert any("warmup_steps" in w for w in schedule.warnings)


def test_ratio_times_total_is_not_spoiled_by_float_rounding():
    # 0.29 × 100 is 28.999999999999996 in binary floating point; the spec means 29.
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 1.0, "warmup_ratio": 0.29}
    assert build_scheduler(typed(sec), 100).boundaries()["warm-up end"] == 29


def test_values_are_python_floats():
    sec = {"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 3}
    assert all(type(build_scheduler(typed(sec), T).lr_at(t)) is float for t in range(0, T + 2))
