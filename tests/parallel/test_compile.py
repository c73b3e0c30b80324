"""Regional torch.compile of the transformer blocks (parallel/compile.py)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.sections_speed import CompileConfig
from lmforge.parallel.compile import CompileWatch, compile_blocks
from tiny_fp32 import grads, max_rel, tiny_model


def test_blocks_are_compiled_in_place_with_unchanged_names():
    from types import SimpleNamespace

    from lmforge.train.builder import _with_compile

    model = tiny_model("qwen3", num_hidden_layers=3)
    names = list(model.state_dict())
    recomputed = []
    hook = _with_compile(recomputed.append, SimpleNamespace(compile=CompileConfig(enable=True)))
    hook(model)  # the builder's hook: recompute/swap first, then compile
    assert recomputed == [model]
    assert _with_compile(None, SimpleNamespace(compile=CompileConfig())) is None
    assert list(model.state_dict()) == names  # checkpoints and resume see the same keys
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.layers)
    assert model.token_loss._compiled_chunk is not None  # the chunked loss's per-chunk step (the default)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="compile.mode"):
        CompileConfig(enable=True, mode="fast")


@pytest.mark.slow
def test_compiled_blocks_with_recompute_match_eager_and_recompile_once_for_new_lengths():
    from lmforge.parallel.activation_wrappers import recompute_module

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 128, (2, s), generator=g), None) for s in (16, 24, 40)]
    # Packed documents: attention over spans is a graph break, so new spans must not recompile.
    ids = torch.randint(0, 128, (2, 40), generator=g)
    batches += [
        (ids, torch.tensor([[9, 30, 40], [17, 40, 40]])),
        (ids, torch.tensor([[5, 11, 40], [33, 40, 40]])),
    ]
    runs = []
    for compiled in (False, True):
        model = tiny_model("qwen3", num_hidden_layers=2, hidden_size=32, intermediate_size=48).train()
        for layer in model.decoder.layers:  # activation recompute wraps the block, as recompute.mode does
            recompute_module(layer)
        if compiled:
            compile_blocks(model, CompileConfig(enable=True))
            watch = CompileWatch()
        losses, spent = [], []
        for ids, ends in batches:
            out = model(ids, labels=ids, actual_seq_len=ends)
            out.loss.backward()
            losses.append(out.loss.detach())
            if compiled:
                spent.append(watch.after_step(len(spent) + 1))
        runs.append((losses, grads(model)))
    (ref_l, ref_g), (got_l, got_g) = runs
    for a, b in zip(got_l, ref_l, strict=True):
        assert max_rel(a, b) <= 1e-5
    for name in ref_g:
        assert max_rel(got_g[name], ref_g[name]) <= 1e-4, name
    # The first length compiles, the second recompiles once with the length dynamic, later ones reuse it;
    # the first document batch compiles the pieces around the attention, other spans reuse them.
    assert spent[0] > 0 and spent[2] == 0 and spent[4] == 0
