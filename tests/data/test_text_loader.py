"""TextDataLoader: local text / HF datasets tokenized on the fly, packed, blended, resumable."""

from __future__ import annotations

import logging

import pytest
import torch

from lmforge.data import build_dataloader
from lmforge.errors import ConfigError, DataError

from .helpers import typed
from .text_helpers import text_rows, token_id, write_jsonl, write_tokenizer

S = 16


def _section(data_path, tokenizer, workers=0, **loader):
    return {
        "dataloader": {
            "type": "TextDataLoader",
            "data_path": data_path if isinstance(data_path, list) else [data_path],
            "tokenizer": tokenizer,
            "seq_length": S,
            "column_names": ["input_ids", "labels", "loss_mask", "position_ids", "actual_seq_len"],
            **loader,
        },
        "num_parallel_workers": workers,
    }


def _batches(section, n, lbs=2, **kw):
    loader = build_dataloader(typed(section), local_batch_size=lbs, **kw)
    out = [next(loader) for _ in range(n)]
    loader.close()
    return out


def _ids(text: str) -> list[int]:
    return [token_id(w) for w in text.split()]


@pytest.fixture
def tok(tmp_path):
    return write_tokenizer(tmp_path / "tok")


def test_concat_packing_is_the_document_stream_cut_into_rows(tmp_path, tok):
    rows = text_rows(60)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    batches = _batches(_section(path, tok), 5)
    stream = [t for r in rows for t in [*_ids(r["text"]), 0]]  # eod = <|endoftext|> = 0
    for k, b in enumerate(batches):
        for j in range(2):
            row = 2 * k + j
            expected = stream[row * (S + 1) : (row + 1) * (S + 1)]
            assert b["input_ids"][j].tolist() == expected[:-1]
            assert b["labels"][j].tolist() == expected[1:]
            # documents restart positions after each eod; actual_seq_len lists the document ends
            ends = [i + 1 for i, t in enumerate(expected[:-1]) if t == 0 and i + 1 < S]
            starts = [0, *ends]
            pos = [i - max(s for s in starts if s <= i) for i in range(S)]
            assert b["position_ids"][j].tolist() == pos
            act = b["actual_seq_len"][j].tolist()
            assert act[: len(ends)] == [e + j * S for e in ends] and set(act[len(ends) :]) == {S + j * S}
    assert all(b["loss_mask"].eq(1).all() for b in batches)


def test_every_file_format_gives_the_same_batches(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = text_rows(50)
    paths = {
        "jsonl": write_jsonl(tmp_path / "a.jsonl", rows),
        "gz": write_jsonl(tmp_path / "a.jsonl.gz", rows, compress=True),
    }
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=7)
    paths["parquet"] = str(tmp_path / "a.parquet")
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=9):
            w.write_batch(batch)
    paths["arrow"] = str(tmp_path / "a.arrow")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    paths["save_to_disk"] = str(tmp_path / "saved")
    write_jsonl(tmp_path / "parts" / "0.jsonl", rows[:20]) if (tmp_path / "parts").mkdir() is None else None
    write_jsonl(tmp_path / "parts" / "1.jsonl", rows[20:])
    paths["glob"] = str(tmp_path / "parts" / "*.jsonl")
    reference = _batches(_section(paths["jsonl"], tok), 6)
    for name, path in paths.items():
        got = _batches(_section(path, tok), 6)
        for a, b in zip(reference, got):
            for c in a:
                assert torch.equal(a[c], b[c]), (name, c)


@pytest.mark.slow  # the fork server's start-up (it imports torch through lmforge.data)
def test_worker_processes_give_the_same_stream(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", text_rows(400))
    a = _batches(_section(path, tok), 30)
    b = _batches(_section(path, tok, workers=2), 30)
    for x, y in zip(a, b):
        assert all(torch.equal(x[c], y[c]) for c in x)


def test_resume_continues_bitwise_without_retokenizing_the_start(tmp_path, tok, monkeypatch):
    from lmforge.data import text_format

    path = write_jsonl(tmp_path / "a.jsonl", text_rows(300))
    (tmp_path / "b").mkdir()
    rows_b = text_rows(300, seed=1)
    write_jsonl(tmp_path / "b" / "0.jsonl.gz", rows_b[:8], compress=True)
    write_jsonl(tmp_path / "b" / "1.jsonl", rows_b[8:])
    other = str(tmp_path / "b")  # a directory of files: the position crosses a file boundary
    section = _section(["0.6", path, "0.4", other], tok)
    straight = _batches(section, 12)
    loader = build_dataloader(typed(section), local_batch_size=2)
    for _ in range(8):
        next(loader)
    state = loader.state_dict()
    assert state["consumed_samples"] == 16
    assert state["text"]["positions"][1]["doc"] > 8  # past b/0.jsonl.gz: resume skips that file by its length
    seen = []
    original = text_format.RowFormatter.encode_rows

    def counting(self, rows, source, locations=None):
        seen.extend(i for i, _ in rows)
        return original(self, rows, source, locations)

    monkeypatch.setattr(text_format.RowFormatter, "encode_rows", counting)
    resumed = build_dataloader(typed(section), local_batch_size=2, consumed_samples=16)
    resumed.load_state_dict(state)
    for k in range(8, 12):
        b = next(resumed)
        assert all(torch.equal(b[c], straight[k][c]) for c in b)
    assert min(seen) >= min(p["doc"] for p in state["text"]["positions"])  # nothing before the position


def test_resume_without_position_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", text_rows(30))
    loader = build_dataloader(typed(_section(path, tok)), local_batch_size=2, consumed_samples=8)
    with pytest.raises(DataError, match="same number of data-parallel ranks"):
        next(loader)


def test_blending_follows_the_weights_and_ranks_read_disjoint_documents(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", text_rows(400, vocab=range(0, 20)))
    b = write_jsonl(tmp_path / "b.jsonl", text_rows(400, seed=1, vocab=range(20, 40)))
    batches = _batches(_section(["3", a, "1", b], tok), 20)
    from_a = sum(int(row[row > 0].max()) < token_id("w20") for bt in batches for row in bt["input_ids"])
    assert from_a == 30  # 40 rows, weights 0.75 / 0.25
    ranks = [_batches(_section(a, tok), 3, lbs=1, dp_rank=r, dp_size=2) for r in (0, 1)]
    rows = text_rows(400, vocab=range(0, 20))
    even = [t for r in rows[0::2] for t in [*_ids(r["text"]), 0]]
    odd = [t for r in rows[1::2] for t in [*_ids(r["text"]), 0]]
    assert ranks[0][0]["input_ids"][0].tolist() == even[:S]
    assert ranks[1][0]["input_ids"][0].tolist() == odd[:S]


def test_whole_packing_never_splits_a_document(tmp_path, tok):
    rows = text_rows(80)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    docs = [[*_ids(r["text"]), 0] for r in rows]
    batches = _batches(
        _section(
            path, tok, pack="whole", column_names=["input_ids", "labels", "loss_mask", "attention_mask"]
        ),
        6,
    )
    placed = []
    for b in batches:
        for j in range(2):
            full = [*b["input_ids"][j].tolist(), b["labels"][j, -1].item()]
            mask = b["attention_mask"][j, 0]
            # every position attends only inside its document (block-diagonal causal)
            i = 0
            while i < S + 1 and len(placed) < len(docs):
                d = docs[len(placed)]
                if full[i : i + len(d)] != d:
                    break
                if i + len(d) <= S:
                    block = ~mask[i : i + len(d), : i + len(d)]
                    assert not block[:, :i].any()
                placed.append(d)
                i += len(d)
            assert all(t == 0 for t in full[i:])  # padding (pad = eod) fills the rest
            assert not b["loss_mask"][j, max(i - 1, 0) :].any() or i == S + 1
    assert len(placed) > 10


def test_python_multiprocessing_is_typed_and_warned_about(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "a.jsonl", text_rows(5))
    section = _section(path, tok, python_multiprocessing=True)
    caplog.set_level(logging.WARNING, logger="lmforge")
    build_dataloader(typed(section), local_batch_size=1).close()
    assert "python_multiprocessing has no effect" in caplog.text
    section["dataloader"]["python_multiprocessing"] = "yes"
    with pytest.raises(ConfigError, match="python_multiprocessing must be"):
        typed(section)


def test_bad_sections_are_clear_errors(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", text_rows(5))
    cases = [
        ({"pack": "zip"}, "pack must be 'concat'"),
        ({"shuffle": "yes"}, "shuffle must be true or false"),  # shuffle: true works (test_text_shuffle.py)
        ({"data_path": [str(tmp_path / "none.jsonl")]}, "names no data"),
        ({"column_names": ["input_ids", "tokens"]}, "column_names must list"),
        ({"chat_template": "{% for %}"}, "not a valid Jinja template"),
        ({"bogus": 1}, "bogus is not a TextDataLoader setting"),
    ]
    for extra, match in cases:
        section = _section(path, tok)
        section["dataloader"].update(extra)
        with pytest.raises(ConfigError, match=match):
            build_dataloader(typed(section), local_batch_size=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "x"}\n')
    with pytest.raises(DataError, match="has neither 'text'"):
        next(build_dataloader(typed(_section(str(bad), tok)), local_batch_size=1))
