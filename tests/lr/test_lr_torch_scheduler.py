"""The torch adapter: update k uses lr_at(k - 1), per-group lr_scale, and a step-only state."""

from __future__ import annotations

import io

import pytest
import torch

from lmforge.lr import ScheduleLR, build_scheduler

from .helpers import typed

SECTION = {
    "type": "WarmUpStableDecayLR",
    "learning_rate": 1e-2,
    "warmup_steps": 3,
    "lr_end": 1e-4,
    "decay_start_ratio": 0.5,
}
TOTAL = 12


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(
        [
            {"params": [model.weight]},
            {"params": [model.bias], "lr_scale": 0.1, "weight_decay": 0.0},
        ],
        lr=123.0,  # overwritten by the scheduler
    )
    return model, optimizer


def _train(model, optimizer, scheduler, updates: int) -> list[float]:
    seen = []
    for _ in range(updates):
        seen.append(optimizer.param_groups[0]["lr"])
        loss = model(torch.ones(2, 4)).square().sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return seen


def test_update_k_uses_schedule_of_k_minus_1_and_lr_scale():
    schedule = build_scheduler(typed(SECTION), TOTAL)
    model, optimizer = _model_and_optimizer()
    scheduler = ScheduleLR(optimizer, schedule)
    assert optimizer.param_groups[0]["lr"] == schedule.lr_at(0)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.1 * schedule.lr_at(0))
    seen = _train(model, optimizer, scheduler, TOTAL)
    assert seen == [schedule.lr_at(k - 1) for k in range(1, TOTAL + 1)]
    assert scheduler.get_last_lr() == pytest.approx([schedule.lr_at(TOTAL), 0.1 * schedule.lr_at(TOTAL)])
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)


def test_the_state_is_only_the_step_and_resume_is_exact():
    schedule = build_scheduler(typed(SECTION), TOTAL)
    model, optimizer = _model_and_optimizer()
    scheduler = ScheduleLR(optimizer, schedule)
    full = _train(model, optimizer, scheduler, TOTAL)

    model, optimizer = _model_and_optimizer()
    scheduler = ScheduleLR(optimizer, schedule)
    first = _train(model, optimizer, scheduler, 5)
    assert scheduler.state_dict() == {"step": 5}
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)

    # A fresh process: rebuild from the YAML, load the checkpoint, continue.
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model2, optimizer2 = _model_and_optimizer()
    optimizer2.load_state_dict(state["optimizer"])
    scheduler2 = ScheduleLR(optimizer2, build_scheduler(typed(SECTION), TOTAL))
    scheduler2.load_state_dict(state["scheduler"])
    rest = _train(model2, optimizer2, scheduler2, TOTAL - 5)
    assert first + rest == full


def test_tensor_lr_is_updated_in_place():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.5))
    lr_tensor = optimizer.param_groups[0]["lr"]
    schedule = build_scheduler(typed({"type": "LinearWithWarmUpLR", "learning_rate": 1e-3}), 10)
    scheduler = ScheduleLR(optimizer, schedule)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(schedule.lr_at(1))


def test_steps_must_be_whole_and_non_negative():
    schedule = build_scheduler(typed({"type": "ConstantWarmUpLR"}), 10)
    with pytest.raises(ValueError):
        schedule.lr_at(-1)
    with pytest.raises(ValueError):
        schedule.lr_at(1.5)
