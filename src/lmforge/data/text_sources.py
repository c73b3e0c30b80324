"""Rows of local text datasets, read in order from any row index (for exact, cheap resume).

Kinds (chosen from the path):

* ``*.jsonl`` / ``*.json`` (one object per line) and their ``.gz``: read line by line; skipping rows
  counts lines without parsing them.
* ``*.parquet``: ``pyarrow`` record batches; whole row groups are skipped by their metadata.
* ``*.arrow``: Arrow IPC files or streams (what ``datasets`` writes), skipped batch by batch.
* a directory written by ``datasets``' ``save_to_disk``: ``datasets.load_from_disk``, read by index.

A glob (``data/*.jsonl.gz``) or a directory of such files is read file after file, in sorted order.
Every reader streams: memory does not grow with the size of the data.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator
from typing import Any

from lmforge.errors import ConfigError, DataError

FILE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".arrow")


def _needs(package: str, what: str) -> Any:
    try:
        return __import__(package)
    except ImportError:
        raise DataError(f"reading {what} needs the '{package}' package: pip install 'lmforge[hf]'.") from None


def is_saved_dataset(path: str) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk``."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "state.json"))
        or os.path.isfile(os.path.join(path, "dataset_dict.json"))
    )


def resolve_files(path: str, key: str) -> list[str]:
    """The data files of one source path (a file, a glob, a directory of files, or a saved dataset)."""
    if is_saved_dataset(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(FILE_SUFFIXES))
    elif any(c in path for c in "*?["):
        files = sorted(glob.glob(path))
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise ConfigError(
            f"{key} = {path!r} names no data: give a .jsonl/.json(.gz), .parquet or .arrow file, a glob or "
            "directory of them, or a directory written by datasets' save_to_disk."
        )
    bad = [f for f in files if not f.endswith(FILE_SUFFIXES) and not is_saved_dataset(f)]
    if bad:
        raise ConfigError(
            f"{key}: {bad[0]} is not a supported data file (supported: {', '.join(FILE_SUFFIXES)}, or a "
            "save_to_disk directory)."
        )
    return files


def _jsonl_rows(path: str, start: int) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:  # bytes, decoded line by line: an invalid byte is named with its line
        for i, raw in enumerate(f):
            if i < start:
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{i + 1} is not valid UTF-8 (byte {exc.start} of the line: {exc.reason}); convert the "
                    "file to UTF-8 JSON lines."
                ) from None
            if not line.strip():
                raise DataError(f"{path}: line {i + 1} is empty; every line must be one JSON object.")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {i + 1} is not valid JSON ({exc}).") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {i + 1} is not a JSON object.")
            yield row


def _parquet_rows(path: str, start: int) -> Iterator[dict[str, Any]]:
    _needs("pyarrow", "Parquet files")
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    seen = 0
    for g in range(file.num_row_groups):
        n = file.metadata.row_group(g).num_rows
        if seen + n <= start:
            seen += n
            continue
        rows = file.read_row_group(g).to_pylist()
        yield from rows[max(start - seen, 0) :]
        seen += n


def _arrow_batches(f: Any) -> Iterator[Any]:
    import pyarrow as pa

    try:
        reader: Any = pa.ipc.open_file(f)
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        f.seek(0)
        yield from pa.ipc.open_stream(f)


def _arrow_rows(path: str, start: int) -> Iterator[dict[str, Any]]:
    _needs("pyarrow", "Arrow files")
    with open(path, "rb") as f:
        seen = 0
        for batch in _arrow_batches(f):
            n = batch.num_rows
            if seen + n > start:
                yield from batch.to_pylist()[max(start - seen, 0) :]
            seen += n


def _saved_rows(path: str, start: int) -> Iterator[dict[str, Any]]:
    _needs("datasets", "a save_to_disk directory")
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path} is a DatasetDict without a 'train' split (it has {', '.join(ds)}).")
        ds = ds["train"]
    step = 512
    for i in range(start, len(ds), step):
        chunk = ds[i : i + step]
        keys = list(chunk)
        for j in range(len(chunk[keys[0]]) if keys else 0):
            yield {k: chunk[k][j] for k in keys}


def _file_rows(path: str, start: int) -> Iterator[dict[str, Any]]:
    if is_saved_dataset(path):
        return _saved_rows(path, start)
    if path.endswith(".parquet"):
        return _parquet_rows(path, start)
    if path.endswith(".arrow"):
        return _arrow_rows(path, start)
    return _jsonl_rows(path, start)


def _is_json_lines(path: str) -> bool:
    return not is_saved_dataset(path) and not path.endswith((".parquet", ".arrow"))


def _file_length(path: str) -> int:
    if is_saved_dataset(path):
        import datasets

        ds = datasets.load_from_disk(path)
        return len(ds["train"] if isinstance(ds, datasets.DatasetDict) else ds)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.endswith(".arrow"):
        with open(path, "rb") as f:
            return sum(batch.num_rows for batch in _arrow_batches(f))
    return _count_lines(path)


def _count_lines(path: str) -> int:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return sum(1 for _ in f)


class TextSource:
    """The rows of one source in a fixed order, readable from any row index."""

    def __init__(self, path: str, key: str) -> None:
        self.path = path
        self.files = resolve_files(path, key)
        self._lengths: list[int | None] = [None] * len(self.files)

    def where(self, index: int) -> str:
        """Where row ``index`` is, for messages: ``file:line`` (JSON lines: a row is a line) or ``file row i``.
        The lengths of the files before it are counted once when not known yet."""
        offset = 0
        for i, file in enumerate(self.files):
            if self._lengths[i] is None and i < len(self.files) - 1:
                self._lengths[i] = _file_length(file)  # counted once (rows may be read out of order)
            length = self._lengths[i]
            if length is None or index < offset + length or i == len(self.files) - 1:
                local = index - offset
                return f"{file}:{local + 1}" if _is_json_lines(file) else f"{file} row {local}"
            offset += length
        return f"{self.path} row {index}"

    def rows(self, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(row index, row)`` from ``start`` to the end of the source.

        Only the files before the one holding ``start`` are counted (not parsed) to find it."""
        offset = 0
        for i, file in enumerate(self.files):
            if start > offset and i < len(self.files) - 1:
                if self._lengths[i] is None:
                    self._lengths[i] = _file_length(file)
                if offset + self._lengths[i] <= start:
                    offset += self._lengths[i]
                    continue
            local = max(start - offset, 0)
            n = local
            for j, row in enumerate(_file_rows(file, local)):
                yield offset + local + j, row
                n = local + j + 1
            self._lengths[i] = n
            offset += n
