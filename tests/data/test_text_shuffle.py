"""`shuffle: true` for text data: every epoch visits each document once, in a new seeded order
(permuted within windows of `shuffle_buffer` documents), and a resume continues that order exactly."""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.data import build_dataloader
from lmforge.errors import ConfigError

from .helpers import typed
from .text_helpers import WORDS, token_id, write_jsonl, write_tokenizer

DOCS = WORDS[:40]  # one distinct token per document (+ the eod)


def _section(tmp_path, **loader):
    tok = write_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "d.jsonl", [{"text": w} for w in DOCS])
    base = {
        "type": "TextDataLoader",
        "data_path": [str(tmp_path / "d.jsonl")],
        "tokenizer": tok,
        "seq_length": 7,
    }
    return {"dataloader": {**base, **loader}, "num_parallel_workers": 0}


def _stream(loader, batches: int) -> list[int]:
    """The documents in the order the loader packed them (each is one word token then the eod)."""
    words = {token_id(w) for w in DOCS}
    out = []
    for _ in range(batches):
        ids = next(loader)["input_ids"].flatten().tolist()
        out += [t for t in ids if t in words]
    return out


def test_each_epoch_is_a_new_permutation_of_every_document(tmp_path):
    section = _section(tmp_path, shuffle=True, shuffle_buffer=16)
    loader = build_dataloader(typed(section), local_batch_size=2, seq_length=7, seed=3)
    order = _stream(loader, 40)  # 40 x 2 rows x 7 tokens = 560 tokens = 7 epochs of 80
    first, second = order[:40], order[40:80]
    everything = sorted(token_id(w) for w in DOCS)
    assert sorted(first) == everything and sorted(second) == everything
    assert first != second and first != sorted(first)
    # Within windows of 16 documents: the first window's documents come first.
    assert set(first[:16]) == {token_id(w) for w in DOCS[:16]}
    again = _stream(build_dataloader(typed(section), local_batch_size=2, seq_length=7, seed=3), 40)
    other = _stream(build_dataloader(typed(section), local_batch_size=2, seq_length=7, seed=4), 40)
    assert again == order and other != order


def test_unshuffled_reads_the_file_in_order(tmp_path):
    loader = build_dataloader(typed(_section(tmp_path)), local_batch_size=2, seq_length=7)
    assert _stream(loader, 20)[:40] == [token_id(w) for w in DOCS]


def test_resume_continues_the_shuffled_order_exactly(tmp_path):
    section = _section(tmp_path, shuffle=True, shuffle_buffer=16)
    reference = build_dataloader(typed(section), local_batch_size=2, seq_length=7, seed=9)
    for _ in range(23):  # mid-epoch, mid-window
        next(reference)
    state = reference.state_dict()
    expected = [next(reference) for _ in range(30)]
    resumed = build_dataloader(typed(section), local_batch_size=2, seq_length=7, seed=9, consumed_samples=46)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert all(np.array_equal(got[c].numpy(), want[c].numpy()) for c in want)


def test_bad_shuffle_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="shuffle_buffer must be a positive number"):
        build_dataloader(
            typed(_section(tmp_path, shuffle=True, shuffle_buffer=0)), local_batch_size=1, seq_length=7
        )
