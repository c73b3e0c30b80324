"""FSDP2's gradient reduction at a shard group of one rank skips its copy (parallel/fsdp_one_rank.py):
training gives bitwise the same parameters as FSDP2's default reduce-scatter, the reduce output really
is the input buffer, a reduction interrupted between its two buffer requests cannot make a later one
overwrite a gradient, and no all-gather runs at all there (so none is installed)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from lmforge.config import validate_section
from lmforge.optim.builder import build_optimizer
from lmforge.parallel import fsdp
from lmforge.parallel.fsdp_one_rank import make_one_rank_reduce_scatter
from lmforge.train.builder import build_training_model
from lmforge.train.step import TrainStep

SECTION = {
    "model_type": "qwen3",
    "architectures": "Qwen3ForCausalLM",
    "compute_dtype": "bfloat16",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "seq_length": 16,
    "tie_word_embeddings": True,
}
ADAMW = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.01}


def _train(default_comms: bool, steps: int = 3, all_gathers: list | None = None) -> dict[str, torch.Tensor]:
    model, ctx = build_training_model(validate_section("model", dict(SECTION)), seed=0, device="cpu")
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(fsdp_modules) == 3  # two layers and the root (the fixture keeps a unit per layer)
    for m in fsdp_modules:  # installed by apply_fsdp at a shard group of one
        assert (
            type(m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm).__name__
            == "OneRankReduceScatter"
        )
    if default_comms:
        for m in fsdp_modules:
            m.set_custom_reduce_scatter(DefaultReduceScatter())
    if all_gathers is not None:
        for m in fsdp_modules:
            m.set_custom_all_gather(_CountingAllGather(all_gathers))
    return train_steps(model, ctx, SECTION, steps)


def train_steps(model, ctx, section: dict, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps of two micro-batches each (the second reduction accumulates into the first's
    gradients) on fixed random tokens; the full parameters after them."""
    opt = build_optimizer(validate_section("optimizer", ADAMW), model, 1e-3)
    step = TrainStep(model, opt, None, max_norm=1.0, ctx=ctx)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        micro = []
        for _ in range(2):
            ids = torch.randint(0, section["vocab_size"], (2, section["seq_length"] + 1), generator=g)
            micro.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()})
        step(micro)
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


class _CountingAllGather(DefaultAllGather):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def allocate(self, *args, **kwargs):
        self.calls.append("allocate")
        return super().allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.calls.append("call")
        return super().__call__(*args, **kwargs)


@pytest.fixture(autouse=True)
def _unit_per_layer(monkeypatch):
    # At one rank small layers share an FSDP unit (tests/parallel/test_fsdp_units.py); a unit per layer
    # here exercises the one-rank collectives of several groups, each reducing its own gradients.
    monkeypatch.setattr(fsdp, "ONE_RANK_UNIT_PARAMS", 0)


def test_one_rank_comms_train_bitwise_like_fsdp2_defaults():
    ours, default = _train(default_comms=False), _train(default_comms=True)
    assert ours.keys() == default.keys()
    for name in ours:
        assert torch.equal(ours[name], default[name]), name


def test_reduce_output_is_the_input_buffer():
    reduce_scatter = make_one_rank_reduce_scatter([])
    inp = reduce_scatter.allocate((10,), dtype=torch.float32, device=torch.device("cpu"))
    out = reduce_scatter.allocate((10,), dtype=torch.float32, device=torch.device("cpu"))
    assert out.data_ptr() == inp.data_ptr()
    nxt = reduce_scatter.allocate((10,), dtype=torch.float32, device=torch.device("cpu"))
    assert nxt.data_ptr() != inp.data_ptr()  # the next reduction's input is a fresh buffer


def test_interrupted_reduction_never_hands_out_a_gradient_buffer():
    param = torch.nn.Parameter(torch.zeros(10))
    reduce_scatter = make_one_rank_reduce_scatter([param])
    cpu = torch.device("cpu")
    reduce_scatter.allocate((10,), dtype=torch.float32, device=cpu)  # an input; its reduction then fails
    # The next reduction: its input request is taken for the stale pairing's output (harmless: the
    # stale buffer is garbage) and its output request then gets a fresh buffer, which becomes the grad.
    inp = reduce_scatter.allocate((10,), dtype=torch.float32, device=cpu)
    out = reduce_scatter.allocate((10,), dtype=torch.float32, device=cpu)
    param.grad = out.view(10)
    # The following reduction must not be handed the gradient's storage as its input.
    following = reduce_scatter.allocate((10,), dtype=torch.float32, device=cpu)
    assert following.data_ptr() != param.grad.data_ptr()
    assert following.data_ptr() != inp.data_ptr() or inp.data_ptr() != out.data_ptr()


def test_no_all_gather_runs_at_a_group_of_one():
    # FSDP2 (torch >= 2.13) casts each parameter into its compute copy there without calling the
    # all-gather; were that to change, a custom all-gather would be worth installing again.
    calls: list = []
    _train(default_comms=False, steps=1, all_gathers=calls)
    assert calls == []
