"""Megatron indexed datasets: the ``PREFIX.bin`` / ``PREFIX.idx`` pair, read memory-mapped and written.

Byte layout (little-endian, no padding) of ``.idx``, as Megatron-Core writes it:
magic ``MMIDIDX\\0\\0`` (9 B), u64 version = 1, u8 dtype code, u64 sequence count S, u64 length D of
the document index (documents + 1), int32[S] sequence lengths (tokens), int64[S] byte pointers into
``.bin``, int64[D] document index (prefix sums over sequences, 0 ... S), and - only for multimodal
data, which the header does not flag - int8[S] sequence modes. ``.bin`` is the raw concatenation of
the token arrays in the header's dtype.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from lmforge.data.indexed_publish import publish_pair, recover_publish, remove_stale_temporaries
from lmforge.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index length
HEADER_SIZE = HEADER.size  # 34 bytes

# Megatron's dtype codes. Code 7 meant float64 before 2023; current Megatron reads it as float32.
DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_BY_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}


def optimal_token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 when every id fits comfortably (< 65500), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def strip_suffix(path: str | os.PathLike) -> str:
    """``data/x.bin`` / ``data/x.idx`` / ``data/x`` -> ``data/x`` (users often pass a file name)."""
    path = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Read-only view of a Megatron ``.bin``/``.idx`` pair; sequences are numpy views on a memmap.

    ``dataset[i]`` is sequence ``i``; ``get(i, offset, length)`` reads part of one without touching
    the rest. ``multimodal=True`` also reads the int8 sequence-mode array (the header cannot say).
    """

    def __init__(self, prefix: str | os.PathLike, *, multimodal: bool = False) -> None:
        self.prefix = strip_suffix(prefix)
        self.multimodal = multimodal
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        missing = [p for p in (ipath, bpath) if not os.path.isfile(p)]
        if len(missing) == 2:
            raise DataError(
                f"No Megatron dataset at prefix '{self.prefix}': neither {ipath} nor {bpath} exists. "
                "A data path is the prefix shared by the .bin and .idx files (e.g. "
                "'data/demo/train' for data/demo/train.bin + data/demo/train.idx); build one with "
                "'lmforge data preprocess' or 'lmforge data demo'."
            )
        if missing:
            raise DataError(
                f"Incomplete Megatron dataset at prefix '{self.prefix}': {missing[0]} is missing "
                f"while its partner exists. A dataset needs both PREFIX.bin and PREFIX.idx, written "
                "together by the same preprocessing run."
            )
        self._read_index(ipath)
        self._open_bin(bpath)

    # -- index ------------------------------------------------------------------------------
    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        if size < HEADER_SIZE:
            raise DataError(
                f"{path} is truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte header of a "
                "Megatron .idx file. Rebuild the dataset."
            )
        with open(path, "rb") as f:
            magic, version, code, count, doc_len = HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            hint = (
                " (this is the legacy pre-2023 'TNTIDX' format, which current Megatron cannot read either; "
                "re-run preprocessing)"
                if magic.startswith(b"TNTIDX")
                else ""
            )
            raise DataError(
                f"{path} is not a Megatron .idx file: its magic bytes are {magic!r}, expected {MAGIC!r}{hint}."
            )
        if version != VERSION:
            raise DataError(
                f"{path} has index version {version}; only version {VERSION} (Megatron's) is supported."
            )
        if code not in DTYPE_BY_CODE:
            raise DataError(
                f"{path} declares dtype code {code}; valid codes are "
                + ", ".join(f"{c} ({d.name})" for c, d in DTYPE_BY_CODE.items())
                + "."
            )
        self.dtype = DTYPE_BY_CODE[code]
        expected = HEADER_SIZE + 12 * count + 8 * doc_len + (count if self.multimodal else 0)
        if size < expected:
            raise DataError(
                f"{path} is truncated: the header announces {count} sequences and {max(doc_len - 1, 0)} "
                f"documents, which need {expected} bytes, but the file has {size}. Rebuild the dataset."
            )
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._idx_buffer = buf
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=count, offset=off)
        off += 4 * count
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=count, offset=off)
        off += 8 * count
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=doc_len, offset=off)
        off += 8 * doc_len
        self.sequence_modes = (
            np.frombuffer(buf, dtype=np.int8, count=count, offset=off) if self.multimodal else None
        )
        if doc_len < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise DataError(
                f"{path} is inconsistent: its document index must run from 0 to the sequence count "
                f"{count}, but it is [{', '.join(map(str, self.document_indices[:3]))}, ...] of length {doc_len}."
            )
        if doc_len > 1 and bool((np.diff(self.document_indices) < 0).any()):
            bad = int(np.argmax(np.diff(self.document_indices) < 0))
            raise DataError(
                f"{path} is corrupt: its document index decreases at document {bad} "
                f"({int(self.document_indices[bad])} -> {int(self.document_indices[bad + 1])}). Rebuild the dataset."
            )

    def _open_bin(self, path: str) -> None:
        size = os.path.getsize(path)
        itemsize = self.dtype.itemsize
        count = len(self.sequence_lengths)
        needed = int(self.sequence_pointers[-1]) + itemsize * int(self.sequence_lengths[-1]) if count else 0
        if size < needed:
            raise DataError(
                f"{path} is truncated or does not belong to {idx_path(self.prefix)}: the index needs "
                f"{needed} bytes of {self.dtype.name} tokens, the file has {size}. Rebuild the dataset."
            )
        self._check_pointers(size)
        # np.memmap refuses empty files; an empty dataset simply has no bytes to map.
        self._bin_buffer = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        # The whole file as one flat token array (a view), and where each sequence starts in it:
        # slicing these is much cheaper than a frombuffer call per read.
        self.tokens = np.frombuffer(self._bin_buffer, dtype=self.dtype, count=size // itemsize)
        self.token_offsets = self.sequence_pointers // itemsize

    def _check_pointers(self, size: int) -> None:
        """Every sequence must lie inside ``.bin`` (a lying index would train on garbage or nothing)."""
        if not len(self.sequence_lengths):
            return
        itemsize = self.dtype.itemsize
        lengths = self.sequence_lengths.astype(np.int64)
        pointers = self.sequence_pointers
        ends = pointers + lengths * itemsize
        bad = (lengths < 0) | (pointers < 0) | (pointers % itemsize != 0) | (ends > size)
        if bool(bad.any()):
            i = int(np.argmax(bad))
            raise DataError(
                f"{idx_path(self.prefix)} is corrupt or does not belong to {bin_path(self.prefix)}: sequence {i} "
                f"(of {len(lengths)}) claims {int(lengths[i])} tokens at byte {int(pointers[i])}, outside the "
                f"{size}-byte .bin of {self.dtype.name} tokens ({int(bad.sum())} such sequence(s)). Rebuild the dataset."
            )

    # Worker processes started with 'spawn' get the prefix and map the files themselves, instead
    # of a pickled copy of the whole memory map.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "multimodal": self.multimodal}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], multimodal=state["multimodal"])

    # -- access -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when length is None)."""
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=length, offset=start)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences are contiguous in ``.bin``)."""
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return np.zeros(0, self.dtype)
        start = int(self.sequence_pointers[first])
        total = int(self.sequence_lengths[first:last].sum(dtype=np.int64))
        return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=total, offset=start)

    def min_token(self, chunk_tokens: int = 1 << 24) -> int:
        """Smallest token id in ``.bin`` (0 when empty; only signed dtypes can go below)."""
        n = self.num_tokens
        if n == 0 or self.dtype.kind == "u":
            return 0
        data = np.frombuffer(self._bin_buffer, dtype=self.dtype, count=n)
        return int(min(int(data[s : s + chunk_tokens].min()) for s in range(0, n, chunk_tokens)))

    def max_token(self, chunk_tokens: int = 1 << 24) -> int:
        """Largest token id in ``.bin`` (-1 when empty), read in chunks so memory stays flat."""
        n = self.num_tokens
        if n == 0:
            return -1
        data = np.frombuffer(self._bin_buffer, dtype=self.dtype, count=n)
        return int(max(int(data[s : s + chunk_tokens].max()) for s in range(0, n, chunk_tokens)))


class IndexedDatasetWriter:
    """Writes a Megatron ``.bin``/``.idx`` pair byte-compatible with Megatron-Core's builder.

    ``add_item`` appends one sequence, ``end_document`` closes a document, ``add_document`` does
    both for a document split into sequences, ``add_index`` appends a whole existing dataset, and
    ``finalize`` writes the ``.idx``. Both files are written under temporary names and renamed over
    ``PREFIX.bin``/``PREFIX.idx`` only by ``finalize``: a failure (use it as a context manager) leaves
    no half pair and a dataset already at that prefix untouched.
    """

    def __init__(
        self, prefix: str | os.PathLike, dtype: np.dtype | type = np.int32, *, multimodal: bool = False
    ):
        self.prefix = strip_suffix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise DataError(
                f"cannot write a Megatron dataset with dtype {self.dtype.name}; supported: "
                + ", ".join(d.name for d in DTYPE_BY_CODE.values())
            )
        self.multimodal = multimodal
        parent = os.path.dirname(self.prefix)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # Left by an earlier writer of this prefix that crashed or was killed: finish or undo its publish,
        # remove its temporaries (data/indexed_publish.py).
        recover_publish(bin_path(self.prefix), idx_path(self.prefix))
        remove_stale_temporaries(bin_path(self.prefix), idx_path(self.prefix))
        self._tmp_bin = f"{bin_path(self.prefix)}.tmp-{os.getpid()}"
        self._tmp_idx = f"{idx_path(self.prefix)}.tmp-{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._lengths: list[int] = []
        self._modes: list[int] = []
        self._doc_indices: list[int] = [0]
        self._finalized = False

    def add_item(self, tokens: Sequence[int] | np.ndarray, mode: int = 0) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self._lengths.append(array.size)
        if self.multimodal:
            self._modes.append(mode)

    def end_document(self) -> None:
        self._doc_indices.append(len(self._lengths))

    def add_document(
        self,
        tokens: Sequence[int] | np.ndarray,
        lengths: Iterable[int] | None = None,
        modes: Iterable[int] | None = None,
    ) -> None:
        """One document; ``lengths`` splits it into sequences (default: one sequence)."""
        array = np.asarray(tokens, dtype=self.dtype)
        lengths = [array.size] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {lengths} do not add up to the {array.size} tokens given")
        self._bin.write(array.tobytes(order="C"))
        self._lengths.extend(lengths)
        if self.multimodal:
            self._modes.extend(list(modes) if modes is not None else [0] * len(lengths))
        self.end_document()

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every sequence and document of another dataset with the same dtype (shard merge)."""
        other = IndexedDataset(prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise DataError(
                f"cannot merge {other.prefix} ({other.dtype.name}) into {self.prefix} ({self.dtype.name}): "
                "the token dtypes differ."
            )
        offset = len(self._lengths)
        self._lengths.extend(int(n) for n in other.sequence_lengths)
        self._doc_indices.extend(int(d) + offset for d in other.document_indices[1:])
        if self.multimodal and other.sequence_modes is not None:
            self._modes.extend(int(m) for m in other.sequence_modes)
        with open(bin_path(other.prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype="<i4")
        # Byte pointers: the exclusive prefix sum of lengths, times the item size.
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype="<i8", out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_indices = np.asarray(self._doc_indices, dtype="<i8")
        tmp = self._tmp_idx
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_BY_DTYPE[self.dtype], len(lengths), len(doc_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_indices.tobytes())
            if self.multimodal:
                f.write(np.asarray(self._modes, dtype=np.int8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        # Publish: .bin first, then .idx (the index names the file it describes last); the previous pair
        # is kept aside until both are in place, so a crash leaves one complete pair.
        publish_pair(self._tmp_bin, tmp, bin_path(self.prefix), idx_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        """Close and delete what was written (no half pair left behind; an older dataset is kept)."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._finalized:
            self.finalize()
