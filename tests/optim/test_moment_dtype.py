"""Compressed optimizer moments (optimizer.moment_dtype: bfloat16): bytes saved, unbiased rounding,
agreement with fp32 moments, resume, validation and the memory estimate."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import ParallelismConfig, validate_section
from lmforge.errors import ConfigError
from lmforge.optim import build_optimizer
from lmforge.optim.moment_dtype import stochastic_round_to_bf16_

from .optim_helpers import TinyLM, set_random_grads

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _moment_bytes(opt) -> int:
    return sum(
        t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k in MOMENTS
    )


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
def test_bf16_moments_take_half_the_bytes_and_parameters_stay_fp32(kind):
    model = TinyLM()
    n = sum(p.numel() for p in model.parameters())
    extra = {"qk_clip_enabled": False} if kind == "Muon" else {}
    full = build_optimizer(validate_section("optimizer", {"type": kind, **extra}), model, 1e-3)
    small = build_optimizer(
        validate_section("optimizer", {"type": kind, "moment_dtype": "bfloat16", **extra}), TinyLM(), 1e-3
    )
    assert _moment_bytes(small) * 2 == _moment_bytes(full)
    if kind == "AdamW":
        assert _moment_bytes(full) == 8 * n and _moment_bytes(small) == 4 * n  # 2 moments x 4 / x 2 bytes
    assert all(p.dtype == torch.float32 for p in small.state)
    assert all(st[k].dtype == torch.bfloat16 for st in small.state.values() for k in MOMENTS if k in st)


def test_stochastic_rounding_is_unbiased_where_round_to_nearest_is_not():
    # 1 + 2^-9 lies a quarter of the way from 1 to its bf16 neighbour 1 + 2^-7.
    x = torch.full((200_000,), 1.0 + 2**-9, dtype=torch.float32)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_to_bf16_(out, x, seed=1)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert out.double().mean().item() == pytest.approx(1.0 + 2**-9, rel=2e-5)
    assert x.to(torch.bfloat16).double().mean().item() == 1.0  # nearest: the bias stochastic rounding removes
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -2.5])
    out = torch.empty_like(special, dtype=torch.bfloat16)
    stochastic_round_to_bf16_(out, special, seed=2)
    assert out.float().tolist() == [float("inf"), -float("inf"), 0.0, -2.5]


def test_second_moment_with_beta2_0999_tracks_fp32_instead_of_freezing():
    # Each step moves exp_avg_sq by 0.1 %: under bf16's half-ulp, so round-to-nearest would freeze it.
    torch.manual_seed(0)
    p32, p16 = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))
    opts = [
        build_optimizer(
            validate_section("optimizer", {"type": "AdamW", "betas": [0.9, 0.999], "moment_dtype": dt}),
            _Holder(p),
            0.0,
        )
        for dt, p in (("float32", p32), ("bfloat16", p16))
    ]
    for step in range(300):
        g = torch.full((4096,), 1.0 if step < 100 else 2.0)
        for p, opt in zip((p32, p16), opts):
            p.grad = g.clone()
            opt.step()
    v32 = opts[0].state[p32]["exp_avg_sq"]
    v16 = opts[1].state[p16]["exp_avg_sq"].float()
    assert v16.mean().item() == pytest.approx(v32.mean().item(), rel=2e-3)


class _Holder(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.weight = p


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
def test_updates_stay_close_to_fp32_moments_and_resume_is_bitwise(kind):
    extra = {"qk_clip_enabled": False} if kind == "Muon" else {}
    torch.manual_seed(0)
    base = TinyLM()
    runs = {}
    for dt in ("float32", "bfloat16"):
        model = copy.deepcopy(base)
        opt = build_optimizer(
            validate_section("optimizer", {"type": kind, "moment_dtype": dt, **extra}), model, 1e-2
        )
        for step in range(6):
            set_random_grads(model, seed=step)
            opt.step()
        runs[dt] = (model, opt)
    for (name, a), b in zip(runs["float32"][0].named_parameters(), runs["bfloat16"][0].parameters()):
        moved = (a - base.get_parameter(name)).norm()
        assert (a - b).norm() <= 0.05 * moved + 1e-7, name
    # Stop after 3 steps, reload the state into a fresh optimizer, finish: bitwise the same as 6 straight.
    model = copy.deepcopy(base)
    opt = build_optimizer(
        validate_section("optimizer", {"type": kind, "moment_dtype": "bfloat16", **extra}), model, 1e-2
    )
    for step in range(3):
        set_random_grads(model, seed=step)
        opt.step()
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    model = copy.deepcopy(base)
    model.load_state_dict(weights)
    opt = build_optimizer(
        validate_section("optimizer", {"type": kind, "moment_dtype": "bfloat16", **extra}), model, 1e-2
    )
    opt.load_state_dict(saved)
    assert all(st[k].dtype == torch.bfloat16 for st in opt.state.values() for k in MOMENTS if k in st)
    for step in range(3, 6):
        set_random_grads(model, seed=step)
        opt.step()
    for a, b in zip(model.parameters(), runs["bfloat16"][0].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "section, needle",
    [
        ({"type": "AdamW", "moment_dtype": "float16"}, "optimizer.moment_dtype: expected 'float32'"),
        ({"type": "Lion", "moment_dtype": "bfloat16"}, "optimizer.moment_dtype: compressed (bf16) moments"),
    ],
)
def test_moment_dtype_validation(section, needle):
    with pytest.raises(ConfigError) as info:
        build_optimizer(validate_section("optimizer", section), TinyLM(), 1e-3)
    assert needle in str(info.value)


def test_memory_estimate_counts_compressed_moments():
    from lmforge.models import build_model
    from lmforge.parallel.dims import ParallelDims
    from lmforge.tools.memory import estimate_memory

    section = {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    model = build_model(validate_section("model", section), device="meta")
    n = sum(p.numel() for p in model.parameters())
    kw = dict(compute_dtype=torch.bfloat16, seq_length=64, local_batch_size=1, hidden_size=64, num_layers=2)
    dims = ParallelDims.from_section(ParallelismConfig(), 1)
    for kind in ("AdamW", "Muon"):
        full = estimate_memory(model, dims, optimizer_type=kind, vocab_size=256, **kw)
        small = estimate_memory(model, dims, optimizer_type=kind, vocab_size=256, moment_bytes=2, **kw)
        assert small.optimizer_states * 2 == full.optimizer_states
        assert small.total() == full.total() - full.optimizer_states // 2
    assert (
        estimate_memory(
            model, dims, optimizer_type="AdamW", vocab_size=256, moment_bytes=2, **kw
        ).optimizer_states
        == 4 * n
    )
    assert ("optimizer states (bf16)", 4 * n) in estimate_memory(
        model, dims, optimizer_type="AdamW", vocab_size=256, moment_bytes=2, **kw
    ).rows()
