"""JSON-lines text -> Megatron ``.bin``/``.idx`` (the job of Megatron's ``tools/preprocess_data.py``)."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import multiprocessing
import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmforge.errors import DataError
from lmforge.utils.atomic import check_output_file
from lmforge.utils.tokenizer import find_eod_id, load_tokenizer

from .indexed import IndexedDatasetWriter, optimal_token_dtype
from .text_values import text_value

BATCH_DOCUMENTS = 256  # documents per encode_batch call / per task sent to a worker


@dataclass
class PreprocessSummary:
    output_prefix: str
    documents: int
    skipped_empty: int
    tokens: int
    seconds: float
    dtype: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def output_prefix_for(prefix: str, json_key: str) -> str:
    """Megatron's naming: ``{prefix}_{key}_document``."""
    return f"{prefix}_{json_key}_document"


def _open_text(path: str) -> tuple[io.TextIOBase, io.BufferedReader]:
    # Both are returned open; the caller closes them.
    raw = open(path, "rb")  # noqa: SIM115
    if path.endswith(".gz"):
        return gzip.open(raw, "rt", encoding="utf-8"), raw  # noqa: SIM115
    return io.TextIOWrapper(raw, "utf-8"), raw


def read_documents(path: str, json_key: str, progress=None) -> Iterator[str]:
    """The ``json_key`` text of every line; a list of strings (sentences) is joined. Any other value is
    refused with the file and line (``data/text_values.py``)."""
    if not os.path.isfile(path):
        what = "a directory, not a file" if os.path.isdir(path) else "no such file"
        raise DataError(f"--input {path}: {what} (expected one JSON lines file, optionally .gz).")
    stream, raw = _open_text(path)
    with stream, raw:
        try:
            yield from _documents(stream, raw, path, json_key, progress)
        except UnicodeDecodeError as exc:
            raise DataError(
                f"--input {path} is not valid UTF-8 text (byte {exc.start} of a line: {exc.reason}); "
                "convert it to UTF-8 JSON lines first."
            ) from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(
                f"--input {path} ends in .gz but is not a complete gzip file ({exc}); give the uncompressed "
                "file, or re-compress it."
            ) from None


def _documents(
    stream: io.TextIOBase, raw: io.BufferedReader, path: str, json_key: str, progress
) -> Iterator[str]:
    """The records of ``stream``, one document per non-empty line."""
    last = 0
    for number, line in enumerate(stream, start=1):
        if progress is not None:
            position = raw.tell()
            progress.update(position - last)
            last = position
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{number} is not valid JSON ({exc.msg}); expected one object per line."
            ) from None
        if not isinstance(record, dict):
            kind = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean"}.get(type(record))
            raise DataError(
                f"{path}:{number} is {kind or 'a JSON ' + ('null' if record is None else 'number')}, not an object; "
                f"expected one object per line with the text under '{json_key}'."
            )
        if json_key not in record:
            raise DataError(
                f"{path}:{number} has no key '{json_key}' (it has: {', '.join(record) or 'no keys'}); choose it "
                "with --json-key."
            )
        yield text_value(record[json_key], f"{path}:{number}", json_key, allow_list=True)


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class PreprocessInterrupted(BaseException):
    """SIGTERM/SIGHUP during preprocess, raised in the main thread so the writer removes what it wrote."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_cleanly() -> Iterator[None]:
    # By default SIGTERM ends the process at once, leaving PREFIX.bin.tmp-PID behind; as an exception it
    # unwinds through IndexedDatasetWriter, which deletes its temporaries (a SIGKILL still cannot be
    # caught: the next writer of the prefix removes what it left, data/indexed_publish.py).
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise PreprocessInterrupted(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_worker_tokenizer = None


def _load_tokenizer_here(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _init_worker(tokenizer_path: str) -> None:
    # Forked workers inherit the parent's handlers; pool.terminate() must end them plainly.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    _load_tokenizer_here(tokenizer_path)


def _encode(batch: list[str]) -> list[np.ndarray]:
    encodings = _worker_tokenizer.encode_batch(batch, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def preprocess(
    input_path: str,
    tokenizer_path: str,
    output_prefix: str,
    *,
    json_key: str = "text",
    append_eod: bool = False,
    eod_token: str | None = None,
    workers: int = 1,
    progress: bool = False,
    exact_prefix: bool = False,
) -> PreprocessSummary:
    """Tokenize every document and write ``{output_prefix}_{json_key}_document.{bin,idx}``.

    ``exact_prefix=True`` writes ``{output_prefix}.{bin,idx}`` instead. Empty documents are dropped
    (as Megatron does); ``append_eod`` adds the tokenizer's end-of-document id to each document.
    """
    prefix = output_prefix if exact_prefix else output_prefix_for(output_prefix, json_key)
    check_output_file(f"{prefix}.bin", "--output-prefix")
    tokenizer = load_tokenizer(tokenizer_path)
    eod = (
        find_eod_id(tokenizer, tokenizer_path, eod_token, hint="name it with --eod-token")
        if append_eod
        else None
    )
    dtype = optimal_token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    prefix = output_prefix if exact_prefix else output_prefix_for(output_prefix, json_key)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=os.path.getsize(input_path), unit="B", unit_scale=True, desc="tokenizing", leave=False
        )
    start = time.perf_counter()
    pool = None
    batches = _batches(read_documents(input_path, json_key, bar), BATCH_DOCUMENTS)
    try:
        # The workers are forked before the stop handlers are installed: a worker that inherited them
        # and got pool.terminate()'s SIGTERM before its initializer restored the default (a worker
        # still starting: at-fork hooks, a busy machine) raised PreprocessInterrupted where nothing
        # ended it (an at-fork hook swallows it), went on to wait for work that never came, and
        # terminate() waited for it forever.
        pool = _start_pool(workers, tokenizer_path) if workers > 1 else None
        with _signals_stop_cleanly():
            documents, tokens, skipped = _tokenize_into(
                prefix, dtype, batches, pool, tokenizer_path, eod, input_path, json_key
            )
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return PreprocessSummary(prefix, documents, skipped, tokens, time.perf_counter() - start, dtype.name)


def _start_pool(workers: int, tokenizer_path: str) -> Any:
    # fork starts workers without re-importing torch; safe because the parent has only
    # loaded the tokenizer file, not run its thread pool.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers, _init_worker, (os.fspath(tokenizer_path),))


def _tokenize_into(
    prefix: str,
    dtype: np.dtype,
    batches: Iterator[list[str]],
    pool: Any,
    tokenizer_path: str,
    eod: int | None,
    input_path: str = "the input",
    json_key: str = "text",
) -> tuple[int, int, int]:
    """(documents, tokens, empty documents skipped) after writing the pair; on ``pool``'s workers, or
    in this process without one."""
    documents = tokens = skipped = 0
    if pool is not None:
        encoded = pool.imap(_encode, batches, chunksize=1)
    else:
        _load_tokenizer_here(os.fspath(tokenizer_path))
        encoded = map(_encode, batches)
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for batch in encoded:
            for ids in batch:
                if ids.size == 0:
                    skipped += 1
                    continue
                if eod is not None:
                    ids = np.append(ids, eod)
                writer.add_document(ids)
                documents += 1
                tokens += ids.size
        if documents == 0:  # raised inside the writer: nothing is published
            raise DataError(
                f"--input {input_path} holds no document to write ({skipped:,} empty {json_key!r} text(s) "
                "skipped, as Megatron does): an empty .bin/.idx pair would only fail later, when training "
                "finds no sequences. Check --input and --json-key."
            )
    return documents, tokens, skipped
