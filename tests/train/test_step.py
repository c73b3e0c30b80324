"""The step against independent references: a full-batch token mean computed directly, torch's
clip_grad_norm_, and torch.optim.AdamW applied by hand."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.train.parallel_seam import ParallelContext
from lmforge.train.step import SkipPolicy, TrainStep, grad_norms

from .tiny import TinyLM, TinyLoader


def micro_batches(n: int, lbs: int = 2):
    it = iter(TinyLoader(0, lbs, seed=3, masked=True))
    return [next(it) for _ in range(n)]


def reference_loss(model, batches):
    """Mean cross entropy over every valid token of all micro-batches at once."""
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    mask = torch.cat([b["loss_mask"] for b in batches]).bool()
    logits = model(ids).logits
    return F.cross_entropy(logits[mask], labels[mask])


def test_loss_is_global_token_mean_and_grads_match_full_batch():
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    batches = micro_batches(3)
    counts = [int(b["loss_mask"].sum()) for b in batches]
    assert len(set(counts)) > 1  # uneven micro-batches: a mean of means would differ
    # lr 0 so the step leaves weights alone and we can inspect the clipped gradient via a hook.
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = {}
    opt.register_step_pre_hook(
        lambda o, a, k: seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    step = TrainStep(model, opt, None, max_norm=1e9, ctx=ParallelContext())
    result = step(batches)
    expected = reference_loss(ref, batches)
    expected.backward()
    assert result.loss == pytest.approx(float(expected.detach()), rel=1e-6)
    assert result.num_tokens == sum(counts)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(seen[name], p.grad, rtol=1e-5, atol=1e-7)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert result.grad_norm == pytest.approx(float(ref_norm), rel=1e-5)


@pytest.mark.parametrize("ours", [False, True], ids=["torch AdamW", "lmforge AdamW (clip folded)"])
def test_clipping_matches_torch_and_logs_preclip_norm(ours):
    from lmforge.optim.adamw import AdamW

    torch.manual_seed(1)
    model = TinyLM()
    ref = copy.deepcopy(model)
    batches = micro_batches(2)
    # lmforge's AdamW takes the clipping factor into its fused kernel; torch's gets clipped gradients.
    cls = AdamW if ours else torch.optim.AdamW
    opt = cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    max_norm = 0.05
    result = TrainStep(model, opt, None, max_norm=max_norm, ctx=ParallelContext())(batches)
    reference_loss(ref, batches).backward()
    pre = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    ref_opt.step()
    assert result.grad_norm == pytest.approx(float(pre), rel=1e-5) and result.grad_norm > max_norm
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_non_finite_loss_skips_update_and_keeps_weights():
    torch.manual_seed(2)
    model = TinyLM()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.poison = True
    result = TrainStep(model, opt, None, max_norm=1.0, ctx=ParallelContext())(micro_batches(1))
    assert result.skipped and "nan" in result.skip_reason.lower()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state  # nothing applied


def test_spike_threshold_skips_finite_but_large_gradient_norm():
    torch.manual_seed(3)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = SkipPolicy(grad_norm_threshold=1e-3)
    result = TrainStep(model, opt, None, max_norm=1.0, ctx=ParallelContext(), skip_policy=policy)(
        micro_batches(1)
    )
    assert result.skipped and "global_norm_skip_threshold" in result.skip_reason
    assert math.isfinite(result.grad_norm)


def test_embedding_norm_is_its_own_gradient_norm_from_the_same_pass():
    torch.manual_seed(4)
    model = TinyLM()
    ref = copy.deepcopy(model)
    batches = micro_batches(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = TrainStep(model, opt, None, max_norm=1e9, ctx=ParallelContext())(batches)
    reference_loss(ref, batches).backward()
    emb = ref.embedding.word_embeddings.weight.grad
    assert result.embedding_grad_norm == pytest.approx(float(torch.linalg.vector_norm(emb)), rel=1e-5)
    assert result.grad_norm == pytest.approx(
        float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])), rel=1e-5
    )
    assert result.embedding_grad_norm < result.grad_norm


def test_grad_norms_subset_stays_finite_when_another_gradient_is_not():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    a.grad, b.grad = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([math.inf, 1.0])
    total, sub = grad_norms([a, b], ParallelContext(), [a]).tolist()
    assert total == math.inf and sub == 5.0
