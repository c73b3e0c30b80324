"""Muon against torch.optim.Muon and the spec's formulas; Newton-Schulz; split schema; QK-Clip."""

from __future__ import annotations

import copy
import importlib
import logging
import math

import pytest
import torch
from torch import nn

from lmforge.config import validate_section
from lmforge.optim import Muon, build_optimizer, newton_schulz, normalize_ns_schedule
from lmforge.optim.newton_schulz import orthogonalize_many

from .optim_helpers import GQAModel, MLAModel, TinyLM, set_random_grads

FLAT = ((3.4445, -4.7750, 2.0315),)


def _matrices() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 16, bias=False), nn.Linear(16, 48, bias=False), nn.Linear(24, 24, bias=False)
    )


def _ill_conditioned(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen))
    k = min(rows, cols)
    return u[:, :k] @ torch.diag(torch.logspace(0, -2, k)) @ v[:, :k].T


@pytest.mark.parametrize(
    ("coefficients", "ns_steps", "lo", "hi"),
    [
        ([3.4445, -4.7750, 2.0315], 5, 0.6, 1.25),  # Keller's quintic: sigma in about [0.68, 1.2]
        ([[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]], 0, 0.99, 1.01),  # DeepSeek-V4 8 + 2
    ],
    ids=["flat", "segmented"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 48), (48, 24)])
def test_newton_schulz_drives_singular_values_toward_one(coefficients, ns_steps, lo, hi, dtype, shape):
    schedule, _ = normalize_ns_schedule(coefficients, ns_steps)
    x = _ill_conditioned(*shape, seed=1)
    before = torch.linalg.svdvals(x)
    assert before.min() < 0.02  # a spread of 100x before
    sv = torch.linalg.svdvals(newton_schulz(x, schedule, 1e-7, dtype).float())
    assert lo <= sv.min() and sv.max() <= hi


def test_batched_orthogonalisation_equals_one_matrix_at_a_time():
    mats = [_ill_conditioned(16, 32, 0), _ill_conditioned(32, 16, 1), _ill_conditioned(16, 32, 2)]
    mats.append(torch.stack([_ill_conditioned(8, 8, s) for s in range(3)]))
    batched = orthogonalize_many(mats, FLAT * 5, 1e-7, torch.float32)
    for m, b in zip(mats, batched):
        single = newton_schulz(m, FLAT * 5, 1e-7, torch.float32)
        torch.testing.assert_close(b, single, atol=2e-5, rtol=0)


def test_newton_schulz_never_writes_into_its_input():
    x = torch.randn(8, 16).bfloat16()
    before = x.clone()
    newton_schulz(x, FLAT * 5, 1e-7)
    assert torch.equal(x, before)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_agrees_with_torch_muon_match_rms_adamw(nesterov):
    model = _matrices()
    twin = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    section = {"type": "Muon", "weight_decay": 0.1, "nesterov": nesterov, "qk_clip_enabled": False}
    opt = build_optimizer(validate_section("optimizer", section), model, 0.02)
    assert {g["route"] for g in opt.param_groups} == {"muon"}
    ref = torch.optim.Muon(
        twin.parameters(), lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw"
    )
    for step in range(5):
        set_random_grads(model, step)
        set_random_grads(twin, step)
        opt.step()
        ref.step()
    for p, q, p0 in zip(model.parameters(), twin.parameters(), start):
        moved = (q - p0).norm()
        # Same algorithm; torch uses EMA momentum (differs by (1 - mu), which NS removes) and its own
        # bf16 kernel order, so the updates agree to bf16 Newton-Schulz noise (muon.md: 2-4% relative).
        assert (p - q).norm() <= 5e-2 * moved


def test_update_size_is_lr_times_matched_rms_times_sqrt_max_dim():
    model = nn.Linear(64, 32, bias=False)
    w0 = model.weight.detach().clone()
    opt = build_optimizer(
        validate_section(
            "optimizer",
            {
                "type": "Muon",
                "weight_decay": 0.0,
                "qk_clip_enabled": False,
                "ns_coefficients": [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]],
                "ns_dtype": "float32",
            },
        ),
        model,
        0.01,
    )
    model.weight.grad = torch.randn(32, 64)
    opt.step()
    update = w0 - model.weight.detach()
    # Orthogonal update O has RMS sqrt(1/max(A, B)); scaled by 0.2 sqrt(max(A, B)) its RMS is 0.2.
    rms = update.square().mean().sqrt() / 0.01
    assert rms == pytest.approx(0.2, rel=1e-2)
    sv = torch.linalg.svdvals(update / (0.01 * 0.2 * math.sqrt(64)))
    assert sv.min() > 0.99 and sv.max() < 1.01


def test_weight_decay_uses_the_unadjusted_lr():
    model = nn.Linear(8, 8, bias=False)
    w0 = model.weight.detach().clone()
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Muon", "weight_decay": 0.5, "qk_clip_enabled": False}),
        model,
        0.1,
    )
    model.weight.grad = torch.zeros(8, 8)  # zero gradient: NS gives 0, only the decay acts
    opt.step()
    torch.testing.assert_close(model.weight.detach(), w0 * (1 - 0.1 * 0.5))


def test_expert_stacks_are_orthogonalised_per_expert():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.Parameter(torch.randn(3, 8, 12))
            self.single = nn.ParameterList([nn.Parameter(self.stack[e].detach().clone()) for e in range(3)])

    model = Experts()
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Muon", "ns_dtype": "float32", "qk_clip_enabled": False}),
        model,
        0.02,
    )
    for step in range(3):
        g = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(step))
        model.stack.grad = g.clone()
        for e in range(3):
            model.single[e].grad = g[e].clone()
        opt.step()
    for e in range(3):
        torch.testing.assert_close(model.stack[e], model.single[e], atol=1e-6, rtol=0)


def test_fused_weights_are_split_by_the_models_schema():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Parameter(torch.randn(8 + 4 + 4, 12))
            self.q = nn.Parameter(self.qkv[:8].detach().clone())
            self.k = nn.Parameter(self.qkv[8:12].detach().clone())
            self.v = nn.Parameter(self.qkv[12:].detach().clone())

        def muon_split_schema(self):
            return {"qkv": (0, [8, 4, 4])}

    model = Fused()
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Muon", "ns_dtype": "float32", "qk_clip_enabled": False}),
        model,
        0.02,
    )
    for step in range(3):
        g = torch.randn(16, 12, generator=torch.Generator().manual_seed(step))
        model.qkv.grad = g.clone()
        model.q.grad, model.k.grad, model.v.grad = g[:8].clone(), g[8:12].clone(), g[12:].clone()
        opt.step()
    torch.testing.assert_close(model.qkv, torch.cat([model.q, model.k, model.v]), atol=1e-6, rtol=0)


def test_a_schema_that_does_not_add_up_is_rejected():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4))

        def muon_split_schema(self):
            return {"w": (0, [4, 4])}

    with pytest.raises(ValueError, match="do not add up"):
        build_optimizer(
            validate_section("optimizer", {"type": "Muon", "qk_clip_enabled": False}), Bad(), 0.02
        )


def test_adamw_branch_equals_torch_adamw_with_adamw_betas_and_eps():
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = build_optimizer(
        validate_section(
            "optimizer",
            {"type": "Muon", "qk_clip_enabled": False, "adamw_betas": [0.9, 0.98], "adamw_eps": 1e-6},
        ),
        model,
        1e-2,
    )
    adam_names = [n for g in opt.param_groups if g["route"] == "adamw" for n in g["param_names"]]
    by_name = dict(twin.named_parameters())
    wd = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    ref = torch.optim.AdamW(
        [{"params": [by_name[n]], "weight_decay": wd[n]} for n in adam_names],
        lr=1e-2,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    for step in range(5):
        set_random_grads(model, step)
        set_random_grads(twin, step)
        opt.step()
        ref.step()
    params = dict(model.named_parameters())
    assert "embedding.word_embeddings.weight" in adam_names and "output_layer.weight" in adam_names
    for n in adam_names:
        torch.testing.assert_close(params[n], by_name[n], atol=1e-6, rtol=0, msg=n)


# -- QK-Clip ------------------------------------------------------------------------------------------


def _clip_step(model, dtype=torch.float32, threshold=100.0):
    model.to(dtype)
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Muon", "qk_clip_threshold": threshold, "weight_decay": 0.0}),
        model,
        0.0,
    )
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return opt, before


def test_qk_clip_mla_scales_exactly_the_documented_rows():
    model = MLAModel()
    opt, before = _clip_step(model)
    assert model.track_max_logits is True
    model.attn.max_logits.copy_(torch.tensor([50.0, 400.0, 100.0]))  # only head 1 exceeds tau = 100
    opt.step()
    gamma = 100.0 / 400.0
    attn = model.attn
    n, r, v = attn.nope, attn.rope, attn.v
    qb = before["attn.linear_qb.weight"].clone()
    h = 1
    qb[h * (n + r) : h * (n + r) + n] *= math.sqrt(gamma)  # q_nope x sqrt(gamma)
    qb[h * (n + r) + n : (h + 1) * (n + r)] *= gamma  # q_rope x gamma
    kvb = before["attn.linear_kvb.weight"].clone()
    kvb[h * (n + v) : h * (n + v) + n] *= math.sqrt(gamma)  # k_nope x sqrt(gamma); v rows untouched
    torch.testing.assert_close(attn.linear_qb.weight, qb, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(attn.linear_kvb.weight, kvb, atol=1e-7, rtol=1e-6)
    assert torch.equal(
        attn.linear_kv_down.weight.float(), before["attn.linear_kv_down.weight"]
    )  # shared rope key
    assert model.resets == 1 and attn.max_logits.max() == 0


def test_qk_clip_gqa_scales_queries_and_key_per_kv_group():
    model = GQAModel()
    opt, before = _clip_step(model)
    model.max_logits.copy_(torch.tensor([50.0, 400.0, 10.0, 10.0]))
    opt.step()
    s = math.sqrt(0.25)
    q = before["q.weight"].clone()
    q[:6] *= s  # heads 0 and 1 share KV group 0, whose max logit is 400
    k = before["k.weight"].clone()
    k[:3] *= s
    torch.testing.assert_close(model.q.weight, q)
    torch.testing.assert_close(model.k.weight, k)


def test_qk_clip_is_inactive_below_the_threshold_and_with_qk_norm(caplog):
    logging.getLogger("lmforge").propagate = True
    caplog.set_level(logging.WARNING, logger="lmforge")
    model = MLAModel(qk_norm=True)
    opt, before = _clip_step(model)
    assert "QK-norm" in caplog.text
    model.attn.max_logits.fill_(1e4)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    model = MLAModel()
    opt, before = _clip_step(model)
    model.attn.max_logits.fill_(99.0)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_qk_clip_without_model_support_warns(caplog):
    logging.getLogger("lmforge").propagate = True
    caplog.set_level(logging.WARNING, logger="lmforge")
    build_optimizer(validate_section("optimizer", {"type": "Muon"}), nn.Linear(4, 4), 0.02)
    assert "qk_clip_layers" in caplog.text


def test_muon_class_routes_plain_parameters_by_shape():
    lin = nn.Linear(6, 4)
    opt = Muon(lin.parameters(), lr=0.02, qk_clip_enabled=False)
    assert "momentum_buffer" in opt.state[lin.weight] and "exp_avg" in opt.state[lin.bias]


def _reference_ns(x: torch.Tensor, schedule, eps: float) -> torch.Tensor:
    """The spec's formula in fp64, transposing a tall matrix (the independent oracle)."""
    X = x.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + eps)
    for a, b, c in schedule:
        P = X @ X.T
        X = a * X + (b * P + c * P @ P) @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(13, 40), (40, 13), (24, 24)])
@pytest.mark.parametrize("block", [4, 5, 1 << 20])
def test_blocked_symmetric_products_and_one_matrix_path_follow_the_formula(monkeypatch, shape, block):
    # Small thresholds force the large-matrix path (one matrix at a time, Gram matrix and polynomial
    # computed block-triangle only, tall matrices iterated on the right) onto test-sized matrices.
    ns_module = importlib.import_module("lmforge.optim.newton_schulz")
    monkeypatch.setattr(ns_module, "STACK_MAX_ELEMENTS", 0)
    monkeypatch.setattr(ns_module, "SYMMETRIC_BLOCK", block)
    if block < 1 << 20:
        assert ns_module.symmetric_parts(shape) > 1
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    out = newton_schulz(x, FLAT * 5, 1e-7, torch.float32)
    torch.testing.assert_close(out.double(), _reference_ns(x, FLAT * 5, 1e-7), atol=2e-5, rtol=0)
    stacked = newton_schulz(torch.stack([x, 2 * x]), FLAT * 5, 1e-7, torch.float32)
    torch.testing.assert_close(stacked[0], out, atol=2e-5, rtol=0)
    torch.testing.assert_close(stacked[1], out, atol=2e-5, rtol=0)


def test_buffers_kept_across_steps_give_the_same_bits_as_fresh_ones():
    # The Newton-Schulz buffers and scratch persist across steps (CPU); nothing may leak from one step
    # into the next, including when a parameter has no gradient in one step (its bucket shrinks).
    ns_module = importlib.import_module("lmforge.optim.newton_schulz")
    model = _matrices()
    model.append(nn.Linear(32, 16, bias=False))  # shares a shape (and so a buffer) with the first
    twin = copy.deepcopy(model)
    opts = [
        build_optimizer(validate_section("optimizer", {"type": "Muon", "qk_clip_enabled": False}), m, 0.02)
        for m in (model, twin)
    ]
    for step in range(4):
        for m in (model, twin):
            set_random_grads(m, step)
            if step == 1:
                m[3].weight.grad = None
        opts[1]._workspace = ns_module.Workspace()
        for opt in opts:
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
