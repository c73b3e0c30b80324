"""Recompute, comm recompute and swap: identical gradients, less saved activation memory, validation."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.parallel.activation import apply_activation_memory, plan_activation_memory
from lmforge.parallel.activation_layers import find_decoder_layers
from lmforge.parallel.activation_swap import Swapped, count_saved_activation_bytes
from lmforge.parallel.activation_wrappers import Recomputed, _comm_recompute_policy, is_recomputed

from .tiny_decoder import TinyDecoder

NUM_LAYERS = 4


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _run(model):
    """Loss, gradients by name and saved-activation bytes of one forward+backward (dropout on)."""
    model.train()
    ids, labels = _batch()
    torch.manual_seed(123)  # the same dropout masks in every run
    with count_saved_activation_bytes(model) as saved:
        loss = model(ids, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, saved["bytes"]


def _pair():
    torch.manual_seed(0)
    base = TinyDecoder(num_layers=NUM_LAYERS)
    return base, copy.deepcopy(base)


def _assert_bitwise(a, b):
    loss_a, grads_a, _ = a
    loss_b, grads_b, _ = b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_find_decoder_layers_uses_container_keys():
    model = TinyDecoder(num_layers=3)
    layers = find_decoder_layers(model, 3)
    assert [(d.layer_id, d.name) for d in layers] == [(i, f"decoder.layers.{i}") for i in range(3)]


def test_full_recompute_identical_gradients_less_saved_memory():
    base, other = _pair()
    reference = _run(base)
    summary = apply_activation_memory(
        other,
        validate_section("recompute", {"mode": "full", "full_recompute_layer": ["0-2"]}),
        None,
        None,
        NUM_LAYERS,
    ).summary()
    assert "recompute full: layers 0-2" in summary
    names_before = [n for n, _ in base.named_parameters()]
    assert [n for n, _ in other.named_parameters()] == names_before  # names unchanged
    result = _run(other)
    _assert_bitwise(reference, result)
    assert result[2] < reference[2] * 0.6, (result[2], reference[2])


def test_select_recompute_with_graph_mode_alias_and_decoder_relative_pattern():
    base, other = _pair()
    reference = _run(base)
    plan = plan_activation_memory(
        other,
        validate_section(
            "recompute", {"mode": "select", "select_module": {"attention": ["0-1"], "layers.*\\.mlp": ["2"]}}
        ),
        None,
        None,
        NUM_LAYERS,
    )
    assert plan.selected_paths == [
        "decoder.layers.0.self_attention",
        "decoder.layers.1.self_attention",
        "decoder.layers.2.mlp",
    ]
    result = _run(other)
    _assert_bitwise(reference, result)
    assert result[2] < reference[2]


def test_select_skips_children_of_recomputed_modules_and_full_layers():
    _, model = _pair()
    plan = plan_activation_memory(
        model,
        validate_section(
            "recompute",
            {
                "mode": "select",
                "full_recompute_layer": ["0"],
                "select_module": {"self_attention": ["0-1"], "self_attention\\.linear_.*": ["1"]},
            },
        ),
        None,
        None,
        NUM_LAYERS,
    )
    assert plan.full_layers == [0]
    assert plan.selected_paths == ["decoder.layers.1.self_attention"]


def test_select_pattern_matching_nothing_lists_available_paths():
    _, model = _pair()
    with pytest.raises(ConfigError) as err:
        apply_activation_memory(
            model,
            validate_section("recompute", {"mode": "select", "select_module": {"attn": ["0"]}}),
            None,
            None,
            NUM_LAYERS,
        )
    msg = str(err.value)
    assert "recompute.select_module['attn']" in msg
    assert "self_attention.linear_qkv" in msg and "mlp.linear_fc1" in msg


class _CountOps(TorchDispatchMode):
    def __init__(self, name):
        super().__init__()
        self.name = name
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.name in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _mm_in_backward(model):
    ids, labels = _batch()
    torch.manual_seed(123)
    loss = model(ids, labels)
    with _CountOps("aten.mm") as counter:
        loss.backward()
    return counter.count


def test_exclude_op_saves_matching_ops_instead_of_recomputing():
    base, full = _pair()
    sac = copy.deepcopy(base)
    reference = _run(base)
    apply_activation_memory(
        full,
        validate_section("recompute", {"mode": "full", "full_recompute_layer": ["0-3"]}),
        None,
        None,
        NUM_LAYERS,
    )
    apply_activation_memory(
        sac,
        validate_section(
            "recompute", {"mode": "full", "full_recompute_layer": ["0-3"], "exclude_op": ["mm"]}
        ),
        None,
        None,
        NUM_LAYERS,
    )
    _assert_bitwise(reference, _run(sac))
    for m in (base, full, sac):
        m.zero_grad(set_to_none=True)
    plain, recomputed, selective = (_mm_in_backward(m) for m in (base, full, sac))
    # Full recompute re-runs the forward matmuls in backward (qkv, proj and fc1 of each layer; the
    # recompute stops early before fc2, whose output backward does not need); exclude_op=['mm'] keeps them.
    assert recomputed == plain + 3 * NUM_LAYERS
    assert selective == plain


@pytest.mark.parametrize("prefetch", [1, 2])
def test_layer_swap_identical_gradients_less_device_memory_and_prefetch_order(prefetch):
    base, other = _pair()
    reference = _run(base)
    plan = plan_activation_memory(
        other,
        None,
        None,
        validate_section(
            "swap", {"enable": True, "default_prefetch": prefetch, "layer_swap": [{"layers": ["0-1"]}]}
        ),
        4,
    )
    result = _run(other)
    _assert_bitwise(reference, result)
    assert plan.swapper.swapped_bytes > 0
    assert result[2] < reference[2]
    # Backward reaches layer 1 first; its copy back and then layer 0's (prefetched) start.
    assert plan.swapper.fetches_started == [1, 0]


def test_op_swap_identical_gradients():
    base, other = _pair()
    reference = _run(base)
    plan = plan_activation_memory(
        other,
        None,
        None,
        validate_section(
            "swap",
            {
                "enable": True,
                "op_swap": [{"op_name": "attention", "layers": ["0"]}, {"op_name": "mlp", "layers": ["1"]}],
            },
        ),
        NUM_LAYERS,
    )
    assert plan.swapped_paths == ["decoder.layers.0.self_attention", "decoder.layers.1.mlp"]
    result = _run(other)
    _assert_bitwise(reference, result)
    assert plan.swapper.swapped_bytes > 0
    assert result[2] < reference[2]


@pytest.mark.parametrize(
    ("swap", "needle"),
    [
        (
            {"enable": True, "default_prefetch": 0, "layer_swap": [{"layers": ["0"]}]},
            "default_prefetch must be",
        ),
        ({"enable": True, "default_prefetch": 4, "layer_swap": [{"layers": ["0"]}]}, "in [1, 3]"),
        (
            {"enable": True, "default_prefetch": 2, "layer_swap": [{"layers": ["0-2"]}]},
            "highest swapped layer (2)",
        ),
        ({"enable": True, "layer_swap": [{"layers": ["0-4"]}]}, "out of range [0, 3]"),
        ({"enable": True, "layer_swap": [{"layers": ["2", "1"]}]}, "strictly ascending"),
        ({"enable": True, "op_swap": [{"op_name": "nothing_here", "layers": ["0"]}]}, "Available paths"),
    ],
)
def test_swap_validation(swap, needle):
    _, model = _pair()
    with pytest.raises(ConfigError) as err:
        apply_activation_memory(model, None, None, validate_section("swap", swap), NUM_LAYERS)
    assert needle in str(err.value)


def test_swap_with_pipeline_parallel_is_rejected():
    _, model = _pair()
    with pytest.raises(ConfigError, match="swap is not supported with pipeline parallel"):
        apply_activation_memory(
            model,
            None,
            None,
            validate_section("swap", {"enable": True, "layer_swap": [{"layers": ["0"]}]}),
            NUM_LAYERS,
            pipeline_parallel=2,
        )


@pytest.mark.parametrize(
    ("recompute", "needle"),
    [
        ({"mode": "some"}, "must be 'None', 'full', or 'select'"),
        ({"mode": "full"}, "recompute.full_recompute_layer is required"),
        ({"mode": "select"}, "recompute.select_module is required"),
        ({"mode": "full", "full_recompute_layer": ["1-0"]}, "range start must be <= end"),
        ({"mode": "full", "full_recompute_layer": ["x"]}, "invalid layer spec"),
        # Not a regular expression, not a glob, not a part: a pattern that matches nothing.
        ({"mode": "select", "select_module": {"(": ["0"]}}, "matches no submodule"),
    ],
)
def test_recompute_validation(recompute, needle):
    _, model = _pair()
    with pytest.raises(ConfigError) as err:
        apply_activation_memory(model, validate_section("recompute", recompute), None, None, NUM_LAYERS)
    assert needle in str(err.value)


def test_recompute_comm_without_collectives_warns_and_changes_nothing():
    base, other = _pair()
    with pytest.warns(UserWarning, match="no communication ops"):
        summary = apply_activation_memory(
            other,
            None,
            validate_section(
                "recompute_comm", {"enable": True, "select_module": {"self_attention": ["0-3"]}}
            ),
            None,
            NUM_LAYERS,
        ).summary()
    assert "no effect" in summary
    assert not any(is_recomputed(m) for m in other.modules())
    with pytest.raises(ConfigError, match="recompute_comm.select_module is required"):
        apply_activation_memory(
            other, None, validate_section("recompute_comm", {"enable": True}), None, NUM_LAYERS
        )
    # The spec's example 'attention.qkv' names self_attention.linear_qkv (name patterns: parts with the
    # original's aliases), so it applies where there are collectives.
    spec_example = {"enable": True, "select_module": {"attention.qkv": ["0-3"]}}
    summary = apply_activation_memory(
        other, None, validate_section("recompute_comm", spec_example), None, NUM_LAYERS, has_comm_ops=True
    ).summary()
    assert "collectives re-run in backward in" in summary and " 0 module" not in summary
    # A pattern naming nothing: a warning here, an error where it would apply.
    missing = {"enable": True, "select_module": {"attention.nothing": ["0-3"]}}
    with pytest.warns(UserWarning, match="matches no submodule"):
        apply_activation_memory(base, None, validate_section("recompute_comm", missing), None, NUM_LAYERS)
    with pytest.raises(ConfigError, match="matches no submodule"):
        apply_activation_memory(
            base, None, validate_section("recompute_comm", missing), None, NUM_LAYERS, has_comm_ops=True
        )


def test_comm_recompute_policy_recomputes_collectives_and_no_arithmetic():
    x = torch.ones(2, 2)
    recompute, save = CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE
    assert _comm_recompute_policy(
        None, torch.ops._c10d_functional.all_gather_into_tensor.default, x, 2, "0"
    ) == (recompute)
    assert _comm_recompute_policy(None, torch.ops.aten.mm.default, x, x) == save
    assert _comm_recompute_policy(None, torch.ops.aten.add.Tensor, x, x) == save
    assert _comm_recompute_policy(None, torch.ops.aten.cat.default, [x, x]) == save  # not a pending result
    # a buffer made and filled in place (a cached one would be mutated after caching): re-run
    assert _comm_recompute_policy(None, torch.ops.aten.zeros.default, [3]) == recompute
    assert _comm_recompute_policy(None, torch.ops.aten.slice.Tensor, x, 0, 1) == recompute
    assert _comm_recompute_policy(None, torch.ops.aten.fill_.Scalar, x, 0.0) == recompute


def test_disabled_sections_change_nothing():
    base, other = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = apply_activation_memory(
            other,
            validate_section("recompute", {"mode": "None"}),
            validate_section("recompute_comm", {"enable": False}),
            validate_section("swap", {"enable": False}),
            NUM_LAYERS,
        ).summary()
    assert summary.startswith("activation memory: no recompute")
    assert not any(is_recomputed(m) for m in other.modules())


class _TPLikeAttention(torch.nn.Module):
    """An attention stand-in whose forward runs a collective, as tensor parallelism does."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.linear_qkv = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        return torch.tanh(self.linear_qkv(funcol.all_reduce(x, "sum", self.group)))


def test_recompute_comm_re_runs_collectives_in_backward_only(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.group.WORLD

        def build():
            torch.manual_seed(0)
            model = torch.nn.Module()
            model.decoder = torch.nn.Module()
            model.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
            for layer in model.decoder.layers:
                layer.self_attention = _TPLikeAttention(group)
            return model

        def step(model):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
            y = x
            for layer in model.decoder.layers:
                y = layer.self_attention(y)
            with _CountOps("all_reduce") as collectives, _CountOps("aten.mm") as matmuls:
                y.square().sum().backward()
            return collectives.count, matmuls.count, {n: p.grad for n, p in model.named_parameters()}

        plain, comm = build(), build()
        plan = plan_activation_memory(
            comm,
            None,
            validate_section("recompute_comm", {"enable": True, "select_module": {"self_attention": ["0"]}}),
            None,
            2,
            has_comm_ops=True,
        )
        assert plan.comm_paths == ["decoder.layers.0.self_attention"]
        c0, m0, g0 = step(plain)
        c1, m1, g1 = step(comm)
        assert c1 == c0 + 1  # layer 0's forward all_reduce runs again in backward
        assert m1 == m0  # and nothing else is recomputed
        for name in g0:
            assert torch.equal(g0[name], g1[name])
    finally:
        dist.destroy_process_group()


DEEPSEEK = {
    "model_type": "deepseek_v3",
    "architectures": "DeepseekV3ForCausalLM",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "qk_nope_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "seq_length": 16,
    "compute_dtype": "float32",
}


def test_lmforge_model_with_mtp_spec_examples_identical_gradients():
    """The spec's select example ('attention', 'mlp') and an MTP layer id on a real lmforge model."""
    from lmforge.models import build_model

    torch.manual_seed(0)
    base = build_model(validate_section("model", DEEPSEEK))
    other = copy.deepcopy(base)
    assert [d.name for d in find_decoder_layers(base, 3)][-1] == "mtp.layers.0.transformer_layer"
    plan = plan_activation_memory(
        other,
        validate_section(
            "recompute",
            {
                "mode": "select",
                "full_recompute_layer": ["3"],
                "select_module": {"attention": ["0-1"], "mlp": ["2"]},
            },
        ),
        None,
        validate_section("swap", {"enable": True, "layer_swap": [{"layers": ["1"]}], "default_prefetch": 2}),
        3,
    )
    assert plan.selected_paths == [
        "decoder.layers.0.self_attention",
        "decoder.layers.1.self_attention",
        "decoder.layers.2.mlp",
    ]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))

    def run(model):
        with count_saved_activation_bytes(model) as saved:
            out = model(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved["bytes"]

    ref, res = run(base), run(other)
    _assert_bitwise(ref, res)
    assert res[2] < ref[2]
    # recomputed MoE layers do not count their tokens twice
    assert all(
        torch.equal(a, b)
        for a, b in zip(base.tokens_per_expert().values(), other.tokens_per_expert().values())
    )


def test_mtp_layer_recompute_alone_saves_memory():
    from lmforge.models import build_model

    torch.manual_seed(0)
    base = build_model(validate_section("model", DEEPSEEK))
    other = copy.deepcopy(base)
    apply_activation_memory(
        other, validate_section("recompute", {"mode": "full", "full_recompute_layer": ["3"]}), None, None, 3
    )
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    sizes = []
    for model in (base, other):
        with count_saved_activation_bytes(model) as saved:
            model(ids, labels=ids).loss.backward()
        sizes.append(saved["bytes"])
    assert sizes[1] < sizes[0]


def test_recompute_and_swap_under_fsdp2(tmp_path):
    """Applied before fully_shard (as parallelize does): gradients still match the unsharded run."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        base, other = _pair()
        reference = _run(base)
        apply_activation_memory(
            other,
            validate_section(
                "recompute",
                {"mode": "select", "full_recompute_layer": ["0"], "select_module": {"mlp": ["1-2"]}},
            ),
            None,
            validate_section("swap", {"enable": True, "layer_swap": [{"layers": ["2"]}]}),
            NUM_LAYERS,
        )
        for layer in other.decoder.layers:
            fully_shard(layer)
        fully_shard(other)
        loss, grads, _ = _run(other)
        assert torch.equal(loss, reference[0])
        for name, grad in grads.items():
            assert torch.equal(grad.full_tensor(), reference[1][name]), name
    finally:
        dist.destroy_process_group()


def test_plan_reports_wrapped_modules_whose_forward_never_runs():
    _, model = _pair()
    plan = plan_activation_memory(
        model,
        validate_section(
            "recompute", {"mode": "select", "select_module": {"self_attention": ["0"], "mlp": ["1"]}}
        ),
        None,
        None,
        NUM_LAYERS,
    )
    assert plan.never_ran() == ["decoder.layers.0.self_attention", "decoder.layers.1.mlp"]
    # a model that calls the MLP's parts directly would bypass the wrapper
    model.decoder.layers[1].forward = lambda x: x + model.decoder.layers[1].self_attention(x)
    model(*_batch()).backward()
    assert plan.never_ran() == ["decoder.layers.1.mlp"]


def test_the_trainer_gets_the_plan_from_the_builder_not_from_the_model(caplog):
    """``apply_activation_memory`` returns the plan and leaves no attribute on the model; the callback the
    builder makes from it logs the summary and, after the first step, the parts that never ran."""
    from lmforge.train.callbacks.monitor import ActivationPlanCallback

    _, model = _pair()
    attributes = set(vars(model))
    plan = apply_activation_memory(
        model,
        validate_section("recompute", {"mode": "select", "select_module": {"mlp": ["0-1"]}}),
        None,
        None,
        NUM_LAYERS,
    )
    assert set(vars(model)) == attributes
    callback = ActivationPlanCallback(plan)
    with caplog.at_level("INFO", logger="lmforge"):
        callback.on_train_begin(None, None)
        callback.on_step_end(None, None)
    assert f"Activation memory: {plan.summary()}" in caplog.text
    assert "recompute / swap has no effect on decoder.layers.0.mlp, decoder.layers.1.mlp" in caplog.text


def test_pipeline_stage_keeps_global_layer_ids():
    """A pipeline stage holds some layers under their global ids; specs name global ids."""
    from lmforge.parallel.pp import KeyedLayers

    _, model = _pair()
    layers = model.decoder.layers
    model.decoder.layers = KeyedLayers({"2": layers[2], "3": layers[3]})
    plan = plan_activation_memory(
        model,
        validate_section(
            "recompute", {"mode": "select", "full_recompute_layer": ["0-2"], "select_module": {"mlp": ["3"]}}
        ),
        None,
        None,
        4,
    )
    assert [d.layer_id for d in find_decoder_layers(model, 4)] == [2, 3]
    assert [name for name, _ in plan.modules] == ["decoder.layers.2", "decoder.layers.3.mlp"]


def test_swap_survives_a_retained_graph():
    """Backward twice through one graph (retain_graph): the swapped activations are fetched again."""
    base, other = _pair()
    plan = plan_activation_memory(
        other, None, None, validate_section("swap", {"enable": True, "layer_swap": [{"layers": ["0-1"]}]}), 4
    )
    ids, labels = _batch()
    for model in (base, other):
        model.eval()  # no dropout: both backward passes see the same graph values
        loss = model(ids, labels)
        loss.backward(retain_graph=True)
        loss.backward()
    assert plan.swapper.swapped_bytes > 0
    for (name, a), b in zip(base.named_parameters(), other.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_wrappers_show_in_the_module_tree_and_keep_every_name():
    """Recompute / swap are visible wrappers (print, isinstance) that leave names and state_dict keys as they were."""
    base, other = _pair()
    apply_activation_memory(
        other,
        validate_section(
            "recompute", {"mode": "select", "full_recompute_layer": ["0"], "select_module": {"mlp": ["1"]}}
        ),
        None,
        validate_section("swap", {"enable": True, "layer_swap": [{"layers": ["2"]}]}),
        NUM_LAYERS,
    )
    layers = other.decoder.layers
    assert is_recomputed(layers[0]) and is_recomputed(layers[1].mlp) and not is_recomputed(layers[1])
    assert isinstance(layers[2], Swapped) and isinstance(layers[2], type(base.decoder.layers[2]))
    text = repr(other)
    assert (
        "(0): RecomputedLayer(" in text and "(mlp): RecomputedMLP(" in text and "(2): SwappedLayer(" in text
    )
    # Nothing is bound to an instance: every forward comes from a class.
    assert not any("forward" in vars(m) for m in other.modules())
    for what in ("named_parameters", "named_buffers", "named_modules"):
        assert [n for n, _ in getattr(other, what)()] == [n for n, _ in getattr(base, what)()], what
    assert list(other.state_dict()) == list(base.state_dict())
    other.load_state_dict(base.state_dict(), strict=True)
    # Wrapping twice changes nothing; each (wrapper, class) pair is one class.
    apply_activation_memory(
        other,
        validate_section("recompute", {"mode": "full", "full_recompute_layer": ["0-1"]}),
        None,
        None,
        NUM_LAYERS,
    )
    assert type(layers[0]) is type(layers[1]) and type(layers[0]).__mro__.count(Recomputed) == 1


_UNWAITED_SCRIPT = """
import sys, tempfile, torch, torch.distributed as dist
from torch import nn
from lmforge.parallel.activation_wrappers import _comm_recompute_policy, recompute_module
from lmforge.parallel.cp import _all_to_all

class Exchange(nn.Module):  # Ulysses' all-to-all (unbind + cat of a pending result), then a product
    def forward(self, x):
        y = _all_to_all(x * 2, 1, 2, dist.group.WORLD)
        return (y * y).sum()

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
module = Exchange()
recompute_module(module, _comm_recompute_policy)
x = torch.randn(1, 4, 6, 3, requires_grad=True)
for _ in range(3):
    module(x).backward()
assert torch.equal(x.grad, 3 * 8 * x.detach())
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_comm_recompute_waits_for_every_replayed_collective():
    """recompute_comm replays the collectives in backward; the op that reads a replayed all-to-all's result
    is replayed with it, so the collective is waited on (before: torch warned at exit "there are still 3
    unwaited collective calls", one per backward, as the parity run with Ulysses CP showed 32)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _UNWAITED_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "unwaited" not in done.stderr, done.stderr[-2000:]
