"""AdamW (and Lion, LAMB) against torch's optimizers and the papers' formulas; fp32 parameters; resume."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.optim import build_optimizer

from .optim_helpers import TinyLM, set_random_grads

SECTION = {
    "type": "AdamW",
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "weight_decay_exclude": ["linear_proj"],
    "lr_scale": {"*word_embeddings*": 0.5},
}


def _torch_twin(opt, model, twin, cls=torch.optim.AdamW, **kw):
    """The same groups (by name) over ``twin``'s parameters, for a torch optimizer."""
    by_name = dict(twin.named_parameters())
    groups = [
        {"params": [by_name[n] for n in g["param_names"]], "lr": g["lr"], "weight_decay": g["weight_decay"]}
        for g in opt.param_groups
    ]
    return cls(groups, **kw)


def test_adamw_equals_torch_adamw_over_20_steps():
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = build_optimizer(validate_section("optimizer", SECTION), model, 1e-2)
    assert len(opt.param_groups) >= 3
    ref = _torch_twin(opt, model, twin, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for step in range(20):
        set_random_grads(model, step)
        set_random_grads(twin, step)
        opt.step()
        ref.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    # The parameters are the master weights: the state holds no second copy.
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in opt.state.values())


@pytest.mark.parametrize("kind", ["AdamW", "Lion", "LAMB", "Muon"])
def test_low_precision_parameters_are_refused_naming_the_parameter(kind):
    # Updating bf16 weights in place would round every step; the trainer keeps them fp32.
    with pytest.raises(
        ConfigError, match=r"parameter '.*word_embeddings.weight' is torch.bfloat16.*model.float\(\)"
    ):
        build_optimizer(validate_section("optimizer", {"type": kind}), TinyLM(dtype=torch.bfloat16), 1e-3)


@pytest.mark.parametrize(
    ("section", "dtype"),
    [
        (SECTION, torch.float32),
        ({"type": "AdamW", "moment_dtype": "bfloat16"}, torch.float32),
        ({"type": "Lion", "weight_decay": 0.1}, torch.float32),
        ({"type": "LAMB"}, torch.float32),
        ({"type": "AdamW", "offload_states": True}, torch.float32),
        ({"type": "Muon", "qk_clip_enabled": False}, torch.float32),
    ],
    ids=["adamw", "adamw-bf16-moments", "lion", "lamb", "adamw-offload", "muon"],
)
def test_checkpointed_state_resumes_bitwise(section, dtype, tmp_path):
    model = TinyLM(dtype=dtype)
    opt = build_optimizer(validate_section("optimizer", section), model, 1e-2)
    for step in range(3):
        set_random_grads(model, step)
        opt.step()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    for step in range(3, 6):
        set_random_grads(model, step)
        opt.step()

    resumed = TinyLM(dtype=dtype)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(validate_section("optimizer", section), resumed, 1e-2)
    opt2.load_state_dict(ckpt["optim"])
    moments = torch.bfloat16 if section.get("moment_dtype") == "bfloat16" else torch.float32
    for p in resumed.parameters():
        for key, value in opt2.state[p].items():
            if key != "step":
                assert value.dtype == moments, key
    for step in range(3, 6):
        set_random_grads(resumed, step)
        opt2.step()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_offloaded_states_live_with_parameters_in_host_memory():
    """States live next to the parameters (the trainer offloads both with FSDP2's CPU offload): on the
    CPU they step like the resident ones; parameters on an accelerator (meta here) are refused."""
    a, b = TinyLM(), TinyLM()
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer(validate_section("optimizer", {"offload_states": True}), a, 1e-2)
    opt_b = build_optimizer(validate_section("optimizer", {}), b, 1e-2)
    for step in range(4):
        set_random_grads(a, step)
        set_random_grads(b, step)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert opt_a.state[p]["exp_avg"].device.type == "cpu"
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    with pytest.raises(ConfigError, match="optimizer.offload_states: true .* on meta"):
        build_optimizer(validate_section("optimizer", {"offload_states": True}), TinyLM().to("meta"), 1e-2)


def test_lion_matches_the_paper_update():
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = build_optimizer(
        validate_section("optimizer", {"type": "Lion", "betas": [0.9, 0.99], "weight_decay": 0.1}),
        model,
        1e-3,
    )
    wd = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    m = {n: torch.zeros_like(p) for n, p in twin.named_parameters()}
    for step in range(5):
        set_random_grads(model, step)
        grads = set_random_grads(twin, step)
        opt.step()
        with torch.no_grad():
            for n, p in twin.named_parameters():
                c = 0.9 * m[n] + 0.1 * grads[n]
                p.mul_(1 - 1e-3 * wd[n]).sub_(1e-3 * torch.sign(c))
                m[n] = 0.99 * m[n] + 0.01 * grads[n]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_lamb_matches_the_paper_update():
    model = TinyLM()
    twin = copy.deepcopy(model)
    b1, b2, eps, lr = 0.9, 0.999, 1e-6, 1e-2
    opt = build_optimizer(validate_section("optimizer", {"type": "LAMB", "weight_decay": 0.05}), model, lr)
    wd = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    m = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in twin.named_parameters()}
    v = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in twin.named_parameters()}
    ref = {n: p.detach().double().clone() for n, p in twin.named_parameters()}
    for t in range(1, 6):
        set_random_grads(model, t)
        grads = set_random_grads(twin, t)
        opt.step()
        for n, w in ref.items():
            g = grads[n].double()
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            r = (m[n] / (1 - b1**t)) / ((v[n] / (1 - b2**t)).sqrt() + eps) + wd[n] * w
            # Trust ratio 1 when either norm is 0 (a zero-initialised bias), as LAMB implementations do.
            trust = w.norm() / r.norm() if w.norm() > 0 and r.norm() > 0 else 1.0
            ref[n] = w - lr * trust * r
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.double(), ref[n], atol=2e-6, rtol=0, msg=n)


@pytest.mark.parametrize(
    "section", [{"type": "AdamW"}, {"type": "Muon", "qk_clip_enabled": False}], ids=["adamw", "muon"]
)
def test_fqn_state_dict_of_torch_dcp_resumes_bitwise(section):
    # The trainer saves optimizer state through torch.distributed.checkpoint's FQN-keyed state dicts.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = TinyLM(tie=True)
    opt = build_optimizer(validate_section("optimizer", section), model, 1e-2)
    for step in range(2):
        set_random_grads(model, step)
        opt.step()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    weights = copy.deepcopy(model.state_dict())
    assert saved["state"]["embedding.word_embeddings.weight"]["exp_avg"].dtype == torch.float32
    for step in range(2, 4):
        set_random_grads(model, step)
        opt.step()
    resumed = TinyLM(tie=True)
    resumed.load_state_dict(weights)
    opt2 = build_optimizer(validate_section("optimizer", section), resumed, 1e-2)
    set_optimizer_state_dict(resumed, opt2, saved)
    for step in range(2, 4):
        set_random_grads(resumed, step)
        opt2.step()
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
