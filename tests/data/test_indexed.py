"""The .bin/.idx format: exact bytes, round trips, Megatron's own reader, and clear errors."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest

from lmforge.data import IndexedDataset, IndexedDatasetWriter
from lmforge.data.indexed import DTYPE_BY_CODE
from lmforge.errors import DataError

from .helpers import TOY_DOCS, random_docs, write_docs

# The 102 bytes Megatron's IndexedDatasetBuilder writes for the toy documents (data reference §1.4),
# spelled out field by field so the test does not depend on our own writer.
TOY_IDX = (
    b"MMIDIDX\x00\x00"
    + struct.pack("<Q", 1)
    + struct.pack("<B", 8)
    + struct.pack("<Q", 3)
    + struct.pack("<Q", 4)
    + struct.pack("<3i", 4, 3, 6)
    + struct.pack("<3q", 0, 8, 14)
    + struct.pack("<4q", 0, 1, 2, 3)
)
TOY_BIN = bytes.fromhex("0500 0600 0700 0000 0800 0900 0000 0a00 0b00 0c00 0d00 0e00 0000".replace(" ", ""))


def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = pytest.importorskip(
            "megatron.core.datasets.indexed_dataset", reason="megatron-core (dev extra) is not installed"
        )
    return mod


def test_toy_dataset_bytes_match_megatron_layout(tmp_path):
    prefix = write_docs(tmp_path / "toy", TOY_DOCS)
    assert len(TOY_IDX) == 102
    assert (tmp_path / "toy.idx").read_bytes() == TOY_IDX
    assert (tmp_path / "toy.bin").read_bytes() == TOY_BIN
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 3 and ds.num_tokens == 13
    assert [ds[i].tolist() for i in range(3)] == TOY_DOCS
    assert ds.get(2, offset=1, length=3).tolist() == [11, 12, 13]


def test_sentence_split_documents(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s", np.int32) as w:
        w.add_document([1, 2, 3, 4, 5], [2, 3])
        w.add_document([6, 7], [2])
    ds = IndexedDataset(tmp_path / "s")
    assert ds.sequence_lengths.tolist() == [2, 3, 2]
    assert ds.sequence_pointers.tolist() == [0, 8, 20]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.num_documents == 2
    assert ds.document(0).tolist() == [1, 2, 3, 4, 5]
    raw = (tmp_path / "s.idx").read_bytes()
    assert struct.unpack_from("<Q", raw, 26)[0] == 3  # the header's D = documents + 1


@pytest.mark.parametrize("code", sorted(DTYPE_BY_CODE))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_BY_CODE[code]
    docs = [np.arange(n, dtype=np.int64) % 100 for n in (1, 7, 0, 33)]
    with IndexedDatasetWriter(tmp_path / "d", dtype) as w:
        for d in docs:
            w.add_document(d.astype(dtype))
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[17] == code
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == dtype
    for i, d in enumerate(docs):
        assert ds[i].dtype == dtype and ds[i].tolist() == d.astype(dtype).tolist()
    # Rewriting what was read gives the same bytes.
    with IndexedDatasetWriter(tmp_path / "e", ds.dtype) as w:
        for i in range(len(ds)):
            w.add_document(ds[i])
    assert (tmp_path / "e.idx").read_bytes() == raw
    assert (tmp_path / "e.bin").read_bytes() == (tmp_path / "d.bin").read_bytes()


def test_multimodal_modes_round_trip(tmp_path):
    with IndexedDatasetWriter(tmp_path / "m", np.int32, multimodal=True) as w:
        w.add_item([1, 2, 3], mode=0)
        w.add_item([4], mode=1)
        w.end_document()
        w.add_document([5, 6], [1, 1], modes=[1, 0])
    ds = IndexedDataset(tmp_path / "m", multimodal=True)
    assert ds.sequence_modes.tolist() == [0, 1, 1, 0]
    assert ds.document_indices.tolist() == [0, 2, 4]
    assert (tmp_path / "m.idx").stat().st_size == 34 + 12 * 4 + 8 * 3 + 4


def test_add_index_merges_shards(tmp_path):
    write_docs(tmp_path / "a", TOY_DOCS[:2])
    write_docs(tmp_path / "b", TOY_DOCS[2:])
    with IndexedDatasetWriter(tmp_path / "ab", np.uint16) as w:
        w.add_index(tmp_path / "a")
        w.add_index(tmp_path / "b")
    assert (tmp_path / "ab.idx").read_bytes() == TOY_IDX
    assert (tmp_path / "ab.bin").read_bytes() == TOY_BIN


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("multimodal", [False, True])
def test_megatron_builder_writes_the_same_bytes_and_reads_ours(tmp_path, dtype, multimodal):
    mod = megatron_indexed()
    docs = random_docs(3, 40)
    rng = np.random.default_rng(0)
    modes = [int(rng.integers(0, 2)) for _ in docs]
    builder = mod.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=dtype, multimodal=multimodal)
    with IndexedDatasetWriter(tmp_path / "ours", dtype, multimodal=multimodal) as w:
        for doc, mode in zip(docs, modes):
            import torch

            builder.add_item(torch.tensor(doc), mode)
            builder.end_document()
            w.add_item(doc, mode)
            w.end_document()
    builder.finalize(str(tmp_path / "meg.idx"))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "meg.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "meg.bin").read_bytes()
    theirs = mod.IndexedDataset(str(tmp_path / "ours"), multimodal=multimodal)
    assert len(theirs) == len(docs)
    for i, doc in enumerate(docs):
        got = theirs[i][0] if multimodal else theirs[i]
        assert got.tolist() == doc
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))


# -- errors ---------------------------------------------------------------------------------------


def test_missing_half_of_the_pair(tmp_path):
    prefix = write_docs(tmp_path / "toy", TOY_DOCS)
    (tmp_path / "toy.bin").unlink()
    with pytest.raises(DataError, match=r"toy\.bin is missing"):
        IndexedDataset(prefix)
    with pytest.raises(DataError, match="neither"):
        IndexedDataset(tmp_path / "nothing")


@pytest.mark.parametrize(
    ("offset", "payload", "message"),
    [
        (0, b"XXIDIDX\x00\x00", "magic"),
        (0, b"TNTIDX\x00\x00\x00", "legacy"),
        (9, struct.pack("<Q", 2), "version 2"),
        (17, b"\x09", "dtype code 9"),
    ],
)
def test_bad_header(tmp_path, offset, payload, message):
    prefix = write_docs(tmp_path / "toy", TOY_DOCS)
    raw = bytearray((tmp_path / "toy.idx").read_bytes())
    raw[offset : offset + len(payload)] = payload
    (tmp_path / "toy.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=message):
        IndexedDataset(prefix)


def test_truncated_files(tmp_path):
    prefix = write_docs(tmp_path / "toy", TOY_DOCS)
    (tmp_path / "toy.idx").write_bytes(TOY_IDX[:60])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)
    (tmp_path / "toy.idx").write_bytes(TOY_IDX[:20])
    with pytest.raises(DataError, match="header"):
        IndexedDataset(prefix)
    (tmp_path / "toy.idx").write_bytes(TOY_IDX)
    (tmp_path / "toy.bin").write_bytes(TOY_BIN[:-4])
    with pytest.raises(DataError, match="truncated or does not belong"):
        IndexedDataset(prefix)


def test_failed_write_leaves_no_half_pair(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("interrupted")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()
