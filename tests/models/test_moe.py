"""MoE routing, batched experts, balancing (aux losses and expert bias), token counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lmforge.models.common.moe import MoELayer, RouterSettings, TopKRouter, grouped_matmul


def _router(**kw):
    settings = RouterSettings(**{"num_experts": 16, "top_k": 4, **kw})
    torch.manual_seed(0)
    router = TopKRouter(32, settings)
    router.reset_parameters(0.5)
    if router.expert_bias is not None:
        router.expert_bias.normal_(0, 0.1)
    return router


def test_group_limited_topk_matches_brute_force():
    router = _router(
        score_function="sigmoid",
        n_group=4,
        topk_group=2,
        enable_expert_bias=True,
        norm_topk_prob=True,
        scaling_factor=2.5,
    )
    x = torch.randn(50, 32)
    idx, w, _ = router(x, 1)
    scores = torch.sigmoid(x @ router.weight.T)
    choice = scores + router.expert_bias
    for t in range(50):
        # Brute force: best pair of groups by the sum of each group's two best biased scores.
        g = choice[t].view(4, 4)
        gscore = g.topk(2, dim=-1).values.sum(-1)
        keep = set(gscore.topk(2).indices.tolist())
        allowed = [e for e in range(16) if e // 4 in keep]
        best = sorted(allowed, key=lambda e: -choice[t, e].item())[:4]
        assert set(idx[t].tolist()) == set(best)
        assert len({e // 4 for e in idx[t].tolist()}) <= 2  # at most topk_group groups
        raw = scores[t, idx[t]]
        assert torch.allclose(w[t], raw / raw.sum() * 2.5, atol=1e-6)  # weights use unbiased scores


def test_softmax_topk_matches_transformers_qwen3_moe_router():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = _router(score_function="softmax", norm_topk_prob=True)
    ref = Qwen3MoeTopKRouter(
        Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    )
    ref.weight.data.copy_(router.weight.data)
    x = torch.randn(40, 32)
    idx, w, _ = router(x, 1)
    _, ref_w, ref_idx = ref(x)
    ours = torch.zeros(40, 16).scatter_(1, idx, w)
    theirs = torch.zeros(40, 16).scatter_(1, ref_idx, ref_w)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_grouped_matmul_equals_per_expert_matmul():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(int(counts.sum()), 6, requires_grad=True)
    w = torch.randn(4, 7, 6, requires_grad=True)
    out = grouped_matmul(x, w, counts)
    ref, start = [], 0
    for e, c in enumerate(counts.tolist()):
        ref.append(x[start : start + c] @ w[e].T)
        start += c
    assert torch.allclose(out, torch.cat(ref), atol=1e-6)
    g = torch.randn_like(out)
    (gx, gw) = torch.autograd.grad((out * g).sum(), (x, w))
    (rx, rw) = torch.autograd.grad((torch.cat(ref) * g).sum(), (x, w))
    assert torch.allclose(gx, rx, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


def _moe(**kw):
    settings = RouterSettings(**{"num_experts": 8, "top_k": 2, **kw})
    torch.manual_seed(0)
    layer = MoELayer(16, 12, settings)
    layer.router.reset_parameters(0.3)
    for p in (layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight):
        p.data.normal_(0, 0.3)
    return layer


def test_moe_layer_equals_dense_loop_reference():
    layer = _moe(score_function="softmax", norm_topk_prob=True)
    x = torch.randn(2, 5, 16)
    out = layer(x)
    tokens = x.reshape(-1, 16)
    idx, w, _ = layer.router(tokens, 2)
    ref = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for k in range(2):
            e = idx[t, k]
            gate, up = (
                (layer.experts.linear_fc1.weight[e] @ tokens[t]).view(-1, 2).unbind(1)
            )  # gate/up row pairs
            ref[t] += w[t, k] * (layer.experts.linear_fc2.weight[e] @ (F.silu(gate) * up))
    assert torch.allclose(out.reshape(-1, 16), ref, atol=1e-5)


def test_tokens_per_expert_counts_each_routed_slot_once_even_with_recompute():
    layer = _moe()
    x = torch.randn(3, 4, 16, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=False)
    out.sum().backward()  # recomputes the forward inside backward
    assert layer.tokens_per_expert.sum().item() == 3 * 4 * 2
    assert layer.bias_update_counts.sum().item() == 3 * 4 * 2


def test_expert_bias_update_moves_load_toward_balance():
    layer = _moe(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.05)
    with torch.no_grad():
        layer.router.weight[0] += 3.0  # expert 0 attracts most tokens
    torch.manual_seed(1)
    x = torch.randn(4, 32, 16) + 0.5  # a shared direction, so expert 0 wins for most tokens

    def imbalance() -> float:
        layer.bias_update_counts.zero_()
        with torch.no_grad():
            layer(x)
        counts = layer.bias_update_counts.clone()
        return (counts.max() / counts.mean()).item()

    before = imbalance()
    for _ in range(20):
        with torch.no_grad():
            layer(x)
        layer.update_expert_bias()
    after = imbalance()
    assert before > 3.0 and after < 0.6 * before, (before, after)
    assert layer.router.expert_bias[0] < 0  # the overloaded expert is pushed down


def test_aux_losses_are_one_times_coefficient_when_balanced_and_match_formula():
    layer = _moe(score_function="softmax", load_balancing_type="aux_loss", aux_loss_coeff=0.01)
    tokens = torch.randn(20, 16)
    _, _, aux = layer.router(tokens, 1)
    probs = torch.softmax(tokens @ layer.router.weight.T, -1)
    idx = probs.topk(2, -1).indices
    f = torch.zeros(8).index_add_(0, idx.reshape(-1), torch.ones(40)) / 40
    expected = 0.01 * 8 * (f * probs.mean(0)).sum()
    assert torch.allclose(aux, expected, atol=1e-7)
    # Perfect balance (uniform scores, every expert equally often) gives exactly the coefficient.
    seq = _moe(score_function="sigmoid", load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01)
    scores = torch.full((8, 8), 0.5)
    idx = torch.arange(8).view(4, 2).repeat(2, 1)
    assert torch.allclose(seq.router._aux_loss(scores, idx, 2), torch.tensor(0.01))


def test_group_limited_greedy_uses_the_group_maximum():
    router = _router(score_function="softmax", n_group=4, topk_group=1, group_score="max")
    x = torch.randn(30, 32)
    idx, _, _ = router(x, 1)
    probs = torch.softmax(x @ router.weight.T, -1)
    for t in range(30):
        best_group = int(probs[t].view(4, 4).amax(-1).argmax())
        assert {e // 4 for e in idx[t].tolist()} == {best_group}
        assert set(idx[t].tolist()) == set(
            probs[t].view(4, 4)[best_group].topk(4).indices.add(4 * best_group).tolist()
        )
