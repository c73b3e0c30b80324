"""Agreement with independent implementations where the settings coincide.

transformers' ``get_*_schedule_with_warmup`` / ``get_wsd_schedule`` (through their ``lr_lambdas``)
and torch's ``CosineAnnealingLR`` / ``CosineAnnealingWarmRestarts`` (stepped as in training).
"""

from __future__ import annotations

import pytest
import torch

from lmforge.lr import ScheduleLR, build_scheduler

from .helpers import typed

transformers_optimization = pytest.importorskip("transformers.optimization")

BASE = 3e-4


def _optimizer(lr: float = BASE) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _hf_lrs(scheduler, steps) -> list[float]:
    return [BASE * scheduler.lr_lambdas[0](t) for t in steps]


def _ours(section: dict, total: int, steps) -> list[float]:
    schedule = build_scheduler(typed(section), total)
    return [schedule.lr_at(t) for t in steps]


@pytest.mark.parametrize("total, warmup", [(100, 10), (37, 0), (50, 49)])
def test_linear_matches_transformers(total, warmup):
    hf = transformers_optimization.get_linear_schedule_with_warmup(_optimizer(), warmup, total)
    steps = range(total + 5)
    ours = _ours({"type": "LinearWithWarmUpLR", "learning_rate": BASE, "warmup_steps": warmup}, total, steps)
    assert ours == pytest.approx(_hf_lrs(hf, steps), rel=1e-12, abs=1e-20)


@pytest.mark.parametrize("total, warmup, cycles", [(100, 10, 0.5), (64, 0, 0.5), (90, 5, 0.3)])
def test_cosine_matches_transformers(total, warmup, cycles):
    hf = transformers_optimization.get_cosine_schedule_with_warmup(
        _optimizer(), warmup, total, num_cycles=cycles
    )
    # transformers keeps following the cosine past the end; lmforge (and the original) hold lr_end.
    steps = range(total)
    section = {
        "type": "CosineWithWarmUpLR",
        "learning_rate": BASE,
        "warmup_steps": warmup,
        "num_cycles": cycles,
    }
    assert _ours(section, total, steps) == pytest.approx(_hf_lrs(hf, steps), rel=1e-12, abs=1e-20)


@pytest.mark.parametrize("total, decay, warmup", [(100, 60, 10), (80, 33, 0)])
def test_cosine_with_decay_steps_matches_transformers_over_decay_steps(total, decay, warmup):
    # transformers' cosine over `decay` training steps, then lmforge holds lr_end (0 here).
    hf = transformers_optimization.get_cosine_schedule_with_warmup(_optimizer(), warmup, decay)
    section = {
        "type": "CosineWithWarmUpLR",
        "learning_rate": BASE,
        "warmup_steps": warmup,
        "decay_steps": decay,
    }
    assert _ours(section, total, range(decay)) == pytest.approx(
        _hf_lrs(hf, range(decay)), rel=1e-12, abs=1e-20
    )
    assert _ours(section, total, range(decay, total + 3)) == [0.0] * (total + 3 - decay)


@pytest.mark.parametrize("total, warmup, cycles", [(100, 10, 3.0), (81, 0, 1.0)])
def test_restarts_match_transformers(total, warmup, cycles):
    hf = transformers_optimization.get_cosine_with_hard_restarts_schedule_with_warmup(
        _optimizer(), warmup, total, num_cycles=cycles
    )
    steps = range(total + 5)
    section = {
        "type": "CosineWithRestartsAndWarmUpLR",
        "learning_rate": BASE,
        "warmup_steps": warmup,
        "num_cycles": cycles,
    }
    assert _ours(section, total, steps) == pytest.approx(_hf_lrs(hf, steps), rel=1e-12, abs=1e-20)


@pytest.mark.parametrize("total, warmup, power, lr_end", [(100, 10, 1.0, 1e-7), (60, 0, 2.5, 1e-5)])
def test_polynomial_matches_transformers(total, warmup, power, lr_end):
    hf = transformers_optimization.get_polynomial_decay_schedule_with_warmup(
        _optimizer(), warmup, total, lr_end=lr_end, power=power
    )
    steps = range(total + 5)
    section = {
        "type": "PolynomialWithWarmUpLR",
        "learning_rate": BASE,
        "warmup_steps": warmup,
        "lr_end": lr_end,
        "power": power,
    }
    assert _ours(section, total, steps) == pytest.approx(_hf_lrs(hf, steps), rel=1e-12, abs=1e-20)


@pytest.mark.parametrize("total, warmup, decay_start, min_ratio", [(100, 10, 70, 0.1), (50, 0, 30, 0.0)])
def test_wsd_matches_transformers(total, warmup, decay_start, min_ratio):
    hf = transformers_optimization.get_wsd_schedule(
        _optimizer(),
        num_warmup_steps=warmup,
        num_stable_steps=decay_start - warmup,
        num_decay_steps=total - decay_start,
        decay_type="linear",
        min_lr_ratio=min_ratio,
    )
    lr_end = BASE * min_ratio
    # transformers' warm-up starts at min_lr_ratio·base: that is warmup_lr_init = lr_end here.
    section = {
        "type": "WarmUpStableDecayLR",
        "learning_rate": BASE,
        "warmup_steps": warmup,
        "warmup_lr_init": lr_end,
        "lr_end": lr_end,
        "decay_start_steps": decay_start,
    }
    steps = range(total + 5)
    assert _ours(section, total, steps) == pytest.approx(_hf_lrs(hf, steps), rel=1e-12, abs=1e-20)


def _step_both(ours: ScheduleLR, theirs, opt_ours, opt_theirs, updates: int):
    got, want = [], []
    for _ in range(updates):
        got.append(opt_ours.param_groups[0]["lr"])
        want.append(opt_theirs.param_groups[0]["lr"])
        opt_ours.step()
        opt_theirs.step()
        ours.step()
        theirs.step()
    return got, want


@pytest.mark.parametrize("t_max, eta_min", [(25, 0.0), (40, 1e-5)])
def test_cosine_annealing_matches_torch(t_max, eta_min):
    opt_ours, opt_theirs = _optimizer(), _optimizer()
    schedule = build_scheduler(
        typed({"type": "CosineAnnealingLR", "base_lr": BASE, "t_max": t_max, "eta_min": eta_min}), 100
    )
    ours = ScheduleLR(opt_ours, schedule)
    theirs = torch.optim.lr_scheduler.CosineAnnealingLR(opt_theirs, T_max=t_max, eta_min=eta_min)
    got, want = _step_both(ours, theirs, opt_ours, opt_theirs, 3 * t_max)  # includes the periodic part
    # torch computes the lr recursively, so it carries rounding error that the closed form does not.
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("t_0, t_mult, eta_min", [(10, 1, 0.0), (5, 2, 1e-6), (3, 3, 0.0)])
def test_warm_restarts_match_torch(t_0, t_mult, eta_min):
    opt_ours, opt_theirs = _optimizer(), _optimizer()
    section = {"type": "CosineAnnealingWarmRestarts", "base_lr": BASE, "t_0": t_0, "t_mult": t_mult}
    schedule = build_scheduler(typed({**section, "eta_min": eta_min}), 200)
    ours = ScheduleLR(opt_ours, schedule)
    theirs = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt_theirs, T_0=t_0, T_mult=t_mult, eta_min=eta_min
    )
    got, want = _step_both(ours, theirs, opt_ours, opt_theirs, 200)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
