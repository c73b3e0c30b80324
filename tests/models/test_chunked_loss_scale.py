"""The chunked loss with the gradient of its loss sum announced in forward (``grad_scale``, what the train
step does through ``loss_gradient_scale``): the scale is folded in before the logits' gradient is rounded,
a 16-bit weight's gradient is summed in its own dtype over one or two chunks and in fp32 (freed at the end
of forward) over more, and the results stay exact when a different gradient arrives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_chunked_loss import _inputs as chunked_inputs

from lmforge.models.common.loss import (
    announced_gradient_scale,
    chunked_linear_cross_entropy,
    loss_gradient_scale,
    token_cross_entropy,
)
from tiny_fp32 import max_rel, tiny_model


def _inputs(dtype):
    return chunked_inputs(dtype, n=64, h=32)


def _grads(hidden, weight, labels, mask, chunk, announced, applied):
    hidden.grad = weight.grad = None
    total, _ = chunked_linear_cross_entropy(hidden, weight, labels, mask, chunk, grad_scale=announced)
    buffers = total.grad_fn.grads  # what forward keeps for backward
    (total * applied).backward()
    return hidden.grad.clone(), weight.grad.clone(), buffers


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("applied", [0.25, 0.7])
def test_fp32_gradients_are_exact_whatever_gradient_arrives(chunk, applied):
    hidden, weight, labels, mask = _inputs(torch.float32)
    ref_sum, _ = token_cross_entropy(F.linear(hidden, weight), labels, mask)
    (ref_sum * applied).backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    gh, gw, _ = _grads(hidden, weight, labels, mask, chunk, announced=0.25, applied=applied)
    assert max_rel(gh, ref_gh) <= 1e-6
    assert max_rel(gw, ref_gw) <= 1e-6


@pytest.mark.parametrize(
    "chunk,kept_dtype",
    [(64, torch.bfloat16), (32, torch.bfloat16), (16, torch.bfloat16)],
)
def test_16_bit_weight_gradient_is_kept_in_its_dtype(chunk, kept_dtype):
    """1 and 2 chunks sum in bf16; 4 chunks sum in fp32 and are rounded before backward: in every case
    no fp32 weight-sized buffer lives from forward to backward once the scale is announced."""
    hidden, weight, labels, mask = _inputs(torch.bfloat16)
    _, _, (grad_h, grad_w) = _grads(hidden, weight, labels, mask, chunk, announced=1 / 50, applied=1 / 50)
    assert grad_w.dtype == kept_dtype and grad_h.dtype == torch.bfloat16
    # Not announced: the weight's gradient waits for backward's scale in fp32.
    _, _, (_, unannounced) = _grads(hidden, weight, labels, mask, chunk, announced=None, applied=1 / 50)
    assert unannounced.dtype == torch.float32


def test_announced_scale_matches_the_plain_path_bitwise_in_one_chunk():
    """One chunk, announced scale: the logits' gradient is scaled and rounded as autograd does on the plain
    path, and the weight's gradient is one bf16 matmul, as there."""
    hidden, weight, labels, _ = _inputs(torch.bfloat16)
    scale = 1 / 62
    ref_sum, _ = token_cross_entropy(F.linear(hidden, weight), labels, None)
    (ref_sum * scale).backward()
    ref_gw = weight.grad.clone()
    _, gw, _ = _grads(hidden, weight, labels, None, 64, announced=scale, applied=scale)
    assert max_rel(gw, ref_gw) <= 1e-2
    assert (gw.float() - ref_gw.float()).abs().max() <= ref_gw.float().abs().max() * 2**-7


@pytest.mark.parametrize("chunks", [1, 2, 4, 16])
def test_16_bit_weight_gradient_is_as_precise_as_the_fp32_sum(chunks):
    """Against an fp64 reference from the same bf16 inputs: announced (bf16 sums for <= 2 chunks, fp32
    beyond) is within 10% of the unannounced fp32 sum's error (measured: better at 1-2 chunks)."""
    n, h, v = 512, 64, 2048
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.1).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    hd, wd = hidden.detach().double(), weight.detach().double()
    p = torch.softmax(hd @ wd.t(), -1)
    p[torch.arange(n), labels] -= 1
    ref = (p / n).t() @ hd

    def err(announced):
        _, gw, _ = _grads(hidden, weight, labels, None, n // chunks, announced=announced, applied=1 / n)
        return ((gw.double() - ref).norm() / ref.norm()).item()

    assert err(1 / n) <= 1.1 * err(None)


def test_the_train_step_announces_its_token_scale(monkeypatch):
    """The model's main loss sees the step's 1/tokens; MTP losses (other gradients) see nothing."""
    from lmforge.models.common import loss as loss_module
    from lmforge.train.parallel_seam import ParallelContext
    from lmforge.train.step import TrainStep

    seen = []
    real = loss_module.chunked_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(args[8] if len(args) > 8 else kwargs.get("grad_scale"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_module, "chunked_linear_cross_entropy", spy)
    model = tiny_model("deepseek_v3", loss_chunk_size=8, num_nextn_predict_layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    labels[0, :5] = -100
    TrainStep(model, opt, None, max_norm=1.0, ctx=ParallelContext())([{"input_ids": ids, "labels": labels}])
    assert seen[0] == pytest.approx(1 / 27)  # 32 labels, 5 ignored
    assert seen[1:] == [None]  # the MTP depth
    assert announced_gradient_scale() is None  # the announcement ends with the forward


def test_announcement_is_scoped():
    assert announced_gradient_scale() is None
    with loss_gradient_scale(0.5):
        assert announced_gradient_scale() == 0.5
        with loss_gradient_scale(0.25):
            assert announced_gradient_scale() == 0.25
        assert announced_gradient_scale() == 0.5
    assert announced_gradient_scale() is None


@pytest.mark.parametrize("announced", [0.0, float("inf"), float("nan")])
def test_a_scale_that_cannot_be_divided_out_is_ignored(announced):
    hidden, weight, labels, mask = _inputs(torch.float32)
    ref_gh, ref_gw, _ = _grads(hidden, weight, labels, mask, 8, announced=None, applied=0.5)
    gh, gw, _ = _grads(hidden, weight, labels, mask, 8, announced=announced, applied=0.5)
    assert torch.equal(gh, ref_gh) and torch.equal(gw, ref_gw)
