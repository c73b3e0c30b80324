"""``training.epochs`` with text data counts the rows once and keeps the count beside the data
(data/epochs_cache.py): a second count reads it, anything that changes the rows counts again.

The reference is the data itself: each document ("wI" + EOD) fills one packed row of seq_length 2
(pack: whole), so one pass is as many rows as documents, split between the data-parallel ranks."""

from __future__ import annotations

import os
import threading
import time

import pytest

from lmforge.config import validate_section
from lmforge.data import epochs as epochs_mod
from lmforge.data import epochs_cache
from lmforge.data.epochs import samples_of_epochs

from .text_helpers import WORDS, write_jsonl, write_tokenizer


def _section(tmp_path, docs: int = 12, seq_length: int = 2):
    tok = write_tokenizer(tmp_path / "tok")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    write_jsonl(data / "docs.jsonl", [{"text": WORDS[i]} for i in range(docs)])
    loader = {
        "type": "TextDataLoader",
        "data_path": [str(data / "docs.jsonl")],
        "tokenizer": tok,
        "pack": "whole",
        "seq_length": seq_length,
    }
    return validate_section("train_dataset", {"dataloader": loader, "num_parallel_workers": 0})


@pytest.fixture
def counts(monkeypatch):
    """The ranks whose rows were counted (tokenizing the split), call by call."""
    counted: list[int] = []
    real = epochs_mod._text_rows

    def spy(settings, epochs, rank, dp_size, seed):
        counted.append(rank)
        return real(settings, epochs, rank, dp_size, seed)

    monkeypatch.setattr(epochs_mod, "_text_rows", spy)
    return counted


@pytest.fixture
def settled(monkeypatch):
    """Files written by the test count as settled at once (the cache waits FRESH_S after a write)."""
    monkeypatch.setattr(epochs_cache, "FRESH_S", 0.0)


def _samples(section, epochs=2, dp_size=2, seed=3):
    return samples_of_epochs(section, epochs, local_batch_size=2, dp_size=dp_size, seed=seed).samples


def _entries(tmp_path):
    return sorted((tmp_path / "data" / epochs_cache.CACHE_SUBDIR).glob("*.json"))


def test_the_rows_are_counted_once_and_read_back(tmp_path, counts, settled):
    section = _section(tmp_path)
    assert _samples(section) == 2 * 12  # two passes of 12 one-row documents
    assert counts == [0, 1] and len(_entries(tmp_path)) == 1
    assert _samples(section) == 2 * 12 and counts == [0, 1]  # read back, nothing tokenized
    assert _samples(section, seed=4) == 2 * 12 and counts == [0, 1]  # without shuffle the seed orders nothing
    assert _samples(section, epochs=3) == 3 * 12 and counts == [0, 1, 0, 1]  # other passes: counted
    assert _samples(section, dp_size=1) == 2 * 12 and counts == [0, 1, 0, 1, 0]


def test_a_changed_data_file_is_counted_again(tmp_path, counts, settled):
    section = _section(tmp_path)
    assert _samples(section) == 2 * 12 and counts == [0, 1]
    _section(tmp_path, docs=16)  # 4 more documents, same path
    assert _samples(section) == 2 * 16 and counts == [0, 1, 0, 1]
    docs = tmp_path / "data" / "docs.jsonl"
    lines = docs.read_text().splitlines(keepends=True)
    docs.write_text("".join(reversed(lines)))  # the same size, only the time differs
    stamp = time.time_ns() - 10**10
    os.utime(docs, ns=(stamp, stamp))
    assert _samples(section) == 2 * 16 and counts == [0, 1, 0, 1, 0, 1]


def test_other_settings_are_counted_again(tmp_path, counts, settled):
    section = _section(tmp_path)
    assert _samples(section) == 2 * 12 and counts == [0, 1]
    with open(tmp_path / "tok" / "tokenizer.json", "a") as f:  # other bytes, the same tokenizer
        f.write("\n")
    assert _samples(section) == 2 * 12 and counts == [0, 1, 0, 1]
    # Rows of 6 tokens hold three documents ("wI" + EOD each): a third of the rows.
    assert _samples(_section(tmp_path, seq_length=5)) == 2 * 12 // 3 and counts == [0, 1, 0, 1, 0, 1]


def test_a_file_written_just_now_is_not_cached(tmp_path, counts, monkeypatch):
    # "Just now" is within FRESH_S (2 s) of the count. Both counts must fall within it, which a busy
    # machine need not manage in 2 s of wall time (tokenizer load and two counts): a day keeps this file
    # fresh for the whole test, and the cache still has to tell a fresh file from a settled one.
    monkeypatch.setattr(epochs_cache, "FRESH_S", 86_400.0)
    section = _section(tmp_path)  # written now: its time could still name other bytes of the same size
    assert _samples(section) == _samples(section) == 2 * 12
    assert counts == [0, 1, 0, 1] and _entries(tmp_path) == []


def test_a_damaged_entry_is_counted_again(tmp_path, counts, settled):
    section = _section(tmp_path)
    assert _samples(section) == 2 * 12
    for entry in _entries(tmp_path):
        entry.write_text('{"key": "not this one", "rows": [1000, 1000]}')
    assert _samples(section) == 2 * 12 and counts == [0, 1, 0, 1]


def test_processes_started_together_count_once(tmp_path, settled, monkeypatch):
    section = _section(tmp_path)
    real = epochs_mod._text_rows
    counting, counted = threading.Event(), []

    def slow(*args):  # the first caller is still counting when the second one looks
        counted.append(args[2])
        counting.set()
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(epochs_mod, "_text_rows", slow)
    results: list[int] = []
    first, second = (
        threading.Thread(target=lambda: results.append(_samples(section, dp_size=1))) for _ in "12"
    )
    first.start()
    assert counting.wait(30)
    second.start()  # finds no entry yet: waits on the lock, then reads what the first one wrote
    first.join()
    second.join()
    assert results == [2 * 12, 2 * 12] and counted == [0] and len(_entries(tmp_path)) == 1


def test_a_directory_that_cannot_hold_the_cache_still_counts(tmp_path, counts, settled):
    section = _section(tmp_path)
    (tmp_path / "data" / "cache").write_text("a file where the cache directory would go")
    assert _samples(section) == _samples(section) == 2 * 12 and counts == [0, 1, 0, 1]
