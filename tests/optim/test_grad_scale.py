"""``step(grad_scale=c)``: the update of gradients multiplied by ``c`` (the trainer's clipping factor),
folded into AdamW's fused kernel, applied to the gradients first by the other rules."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import validate_section
from lmforge.optim import build_optimizer

from .optim_helpers import TinyLM, set_random_grads

SECTIONS = {
    "AdamW": {"type": "AdamW", "betas": [0.9, 0.95], "weight_decay": 0.1},
    "Lion": {"type": "Lion", "betas": [0.9, 0.99], "weight_decay": 0.1},
    "LAMB": {"type": "LAMB", "weight_decay": 0.1},
    "Muon": {"type": "Muon", "weight_decay": 0.1, "qk_clip_enabled": False},
}


@pytest.mark.parametrize("kind", list(SECTIONS))
@pytest.mark.parametrize("scale", [0.37, 1.0 / 65536])
def test_scaled_step_is_the_step_on_scaled_gradients(kind, scale):
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = build_optimizer(validate_section("optimizer", SECTIONS[kind]), model, 1e-2)
    ref = build_optimizer(validate_section("optimizer", SECTIONS[kind]), twin, 1e-2)
    for step in range(6):
        set_random_grads(model, step)
        set_random_grads(twin, step)
        opt.step(grad_scale=scale)
        with torch.no_grad():
            torch._foreach_mul_([p.grad for p in twin.parameters()], scale)
        ref.step()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            # The gradients are left scaled too (AdamW's kernel writes them back divided by 1 / scale).
            torch.testing.assert_close(p.grad, q.grad, rtol=2.5e-7, atol=0, msg=name)
    # Muon folds in its AdamW groups (the same fused kernel) and multiplies for its matrices.
    folded = {n for g in opt.param_groups if g.get("route", "adamw") != "muon" for n in g["param_names"]}
    if kind == "Muon":  # both paths taken
        assert folded and folded != {n for n, _ in model.named_parameters()}
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if kind in ("AdamW", "Muon") and name in folded:
            # The kernel divides by 1 / scale: one rounding away from the product.
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        else:  # the same multiplication, then the same update
            assert torch.equal(p, q), name


def test_adamw_folded_scale_matches_torch_adamw_after_clipping():
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = build_optimizer(
        validate_section("optimizer", {"type": "AdamW", "betas": [0.9, 0.95], "weight_decay": 0.0}),
        model,
        1e-2,
    )
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    for step in range(10):
        set_random_grads(model, step)
        set_random_grads(twin, step)
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
        ref.step()
        opt.step(grad_scale=min(1.0, 0.5 / (float(norm) + 1e-6)))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("scale", [0.0, float("inf")])
def test_a_scale_without_a_finite_inverse_is_applied_to_the_gradients(scale):
    model = TinyLM()
    opt = build_optimizer(validate_section("optimizer", SECTIONS["AdamW"]), model, 1e-2)
    set_random_grads(model, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.grad[0] = 0.0  # 0 x inf = nan where the gradient is zero
    opt.step(grad_scale=scale)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    if scale == 0.0:
        assert torch.equal(grads, torch.zeros_like(grads))
    else:
        assert grads.isnan().any() and grads.isinf().any()
    assert opt.grad_scale == 1.0  # nothing left over for the next step
