"""Context and expert parallelism are visible parts of the model, not methods bound to its modules.

One process, a gloo group of one (cp = 1 / one replica): the wrappers' numbers are checked by the
parity suite; here their shape is: where they sit, that names are unchanged, that they compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lmforge.config import ParallelismConfig, validate_section
from lmforge.models import build_model
from tolerances import reordered

from .harness import tiny_llama


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["colossal", "ulysses"])
def test_context_parallel_attention_is_a_submodule_of_every_core_attention(one_rank, method):
    from torch.distributed.device_mesh import init_device_mesh

    from lmforge.models.common.attention import CoreAttention
    from lmforge.parallel.cp import ContextParallelAttention, apply_cp

    torch.manual_seed(0)
    plain = build_model(validate_section("model", tiny_llama()), seed=3).eval()
    model = build_model(validate_section("model", tiny_llama()), seed=3).eval()
    names = {what: [n for n, _ in getattr(model, what)()] for what in ("named_parameters", "named_buffers")}
    keys = list(model.state_dict())
    apply_cp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))["cp"], method)

    cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
    assert cores and all(isinstance(c.context_parallel, ContextParallelAttention) for c in cores)
    assert f"(context_parallel): ContextParallelAttention(method={method}, cp=1" in repr(model)
    assert not any("forward" in vars(m) for m in model.modules())
    for what, before in names.items():
        assert [n for n, _ in getattr(model, what)()] == before
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, tiny_llama()["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    # The attention is computed in another order (by chunks of the sequence): close in float32, not equal.
    expected = plain(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, **reordered(torch.float32, expected))


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_bias_update_sums_the_counts_of_every_rank_without_a_bound_method():
    from lmforge.models.common.moe import MoELayer, RouterSettings

    from .harness import run_workers

    results = run_workers(2, {"task": "expert_bias_task"}, timeout=60)
    local = [torch.tensor(r["local_counts"]) for r in results]
    assert not torch.equal(local[0], local[1])  # the ranks routed different tokens
    # The bias one process computes from the summed counts, which both ranks must hold.
    ref = MoELayer(
        16, 8, RouterSettings(num_experts=4, top_k=2, enable_expert_bias=True, bias_update_rate=0.1)
    )
    ref.update_expert_bias(local[0] + local[1])
    for r in results:
        assert r["bias"] == ref.router.expert_bias.tolist()


@pytest.mark.parametrize("layout", ["tp", "ep_x_tp"])
def test_routers_and_experts_keep_dtensor_weights_and_read_them_in_their_own_forward(one_rank, layout):
    """No hook swaps local tensors into a router or the routed experts: their weights stay DTensor
    parameters that the module's forward reads itself (``models/common/local_weight.py``); on a mesh of
    one rank the model computes what the plain one does, and the gradients keep the parameters'
    placements (a Partial gradient would reach FSDP and the optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lmforge.models.common.moe import moe_layers
    from lmforge.parallel.ep import apply_ep
    from lmforge.parallel.tp import apply_tp

    from .harness import tiny_qwen3_moe

    plain = build_model(validate_section("model", tiny_qwen3_moe()), seed=3)
    model = build_model(validate_section("model", tiny_qwen3_moe()), seed=3)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("ep", "tp"))
    if layout == "ep_x_tp":
        apply_ep(model, mesh["ep"], ParallelismConfig(), tp_mesh=mesh["tp"])
    apply_tp(model, mesh["tp"])
    weights = []
    for moe in moe_layers(model):
        for module in (moe.router, moe.experts, moe.experts.linear_fc1, moe.experts.linear_fc2):
            assert not module._forward_pre_hooks and not module._forward_hooks, type(module).__name__
        weights += [moe.router.weight, moe.experts.linear_fc1.weight, moe.experts.linear_fc2.weight]
    assert all(isinstance(w, DTensor) for w in weights)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for m in (plain, model):
        m(ids, labels=ids).loss.backward()
    assert torch.equal(model(ids).logits, plain(ids).logits)
    plain_grads = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        if ".router." in name or ".experts." in name:
            assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
            # (DTensor's backward of the other blocks sums in another order: float rounding only)
            torch.testing.assert_close(param.grad.full_tensor(), plain_grads[name].grad, rtol=1e-5, atol=1e-7)
