"""``TextDataLoader``: local text / Hugging Face datasets, tokenized on the fly, packed, blended, resumable.

Each data-parallel rank reads the documents ``d`` with ``d % dp_size == dp_rank`` of every source,
tokenizes them in background worker processes (``train_dataset.num_parallel_workers``; chunks are
sent ahead and come back in order, so the stream is deterministic), packs them into rows
(:mod:`lmforge.data.text_pack`) and blends the sources by weight: the next row comes from the
source furthest behind its share (``weight * rows - taken``), a deterministic rule.

State (in the checkpoint, per rank): the rows produced and, per source, the packing position (epoch,
document, token offset). Resuming re-reads each source from its recorded document; only the
documents after it (and that one) are tokenized. See docs/data.md.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmforge.errors import ConfigError, DataError
from lmforge.utils.logging import get_logger

from .config import parse_blend, unknown_keys_message
from .loader import collate
from .text_format import (
    BUILTIN_TEMPLATES,
    FormatSettings,
    RowFormatter,
    encode_in_worker,
    init_worker,
    tokenizer_chat_template,
)
from .text_pack import Packer, PackPosition, row_columns
from .text_sources import TextSource

log = get_logger("lmforge.data")

KEY = "train_dataset.dataloader"
TEXT_TYPE = "TextDataLoader"
# shuffle: documents are permuted within windows of this many (memory holds one window of raw rows).
DEFAULT_SHUFFLE_BUFFER = 10_000
CHUNK_DOCUMENTS = 256  # documents per encode_batch call / task sent to a tokenization worker
COLUMNS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "actual_seq_len")
_KEYS = {
    "type",
    "data_path",
    "tokenizer",
    "seq_length",
    "column_names",
    "text_key",
    "messages_key",
    "prompt_key",
    "response_key",
    "chat_template",
    "pack",
    "eod",
    "pad",
    "eod_mask_loss",
    "eod_pad_length",
    "shuffle",
    "shuffle_buffer",
    "valid_data_path",
    "validation_split",
    "python_multiprocessing",  # declared by the typed section; workers are always processes here
}
# Multiplicative (Fibonacci) hashing of the document index: the held-out documents are spread evenly
# through each source, the same on every rank and run, without knowing how long the source is.
_GOLDEN = 2654435761


def held_out(index: int, fraction: float) -> bool:
    """Whether document ``index`` of a source belongs to the validation share ``fraction`` of it."""
    return ((index * _GOLDEN) % 2**32) < fraction * 2**32


@dataclass(frozen=True)
class TextLoaderSettings:
    paths: list[str]
    weights: list[float]
    valid_paths: list[str]  # valid_data_path: the validation set's own sources
    validation_split: float  # the share of data_path's documents held out for validation (0: none)
    shuffle_buffer: int | None  # shuffle: the window of documents permuted each epoch; None: file order
    tokenizer: str
    seq_length: int
    columns: list[str]
    pack: str
    eod_mask_loss: bool
    eod_pad_length: int
    format: FormatSettings
    pad: int


def _str(loader: dict[str, Any], key: str, default: str) -> str:
    value = loader.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{KEY}.{key} must be a non-empty string; got {value!r}.")
    return value


def check_text_loader(loader: dict[str, Any]) -> dict[str, Any]:
    """Every per-key check of a TextDataLoader mapping (no file read, no model needed): the typed
    section of ``load_config`` (lmforge.data.schema). Returns the parsed values the loader needs."""
    unknown = sorted(set(loader) - _KEYS)
    if unknown:
        raise ConfigError(unknown_keys_message(KEY, unknown, sorted(_KEYS), TEXT_TYPE))
    if not isinstance(loader.get("shuffle", False), bool):
        raise ConfigError(f"{KEY}.shuffle must be true or false; got {loader['shuffle']!r}.")
    window = loader.get("shuffle_buffer", DEFAULT_SHUFFLE_BUFFER)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(
            f"{KEY}.shuffle_buffer must be a positive number of documents (each window of that many "
            f"consecutive documents is shuffled; default {DEFAULT_SHUFFLE_BUFFER}); got {window!r}."
        )
    if loader.get("data_path") is None:
        raise ConfigError(
            f"{KEY}.data_path is required: a list of files / globs / save_to_disk directories, or weight/path "
            "pairs ['0.7', 'a.jsonl.gz', '0.3', 'b.parquet']."
        )
    blend = parse_blend(loader["data_path"], f"{KEY}.data_path")
    valid = _check_validation_keys(loader)
    tokenizer = loader.get("tokenizer")
    if isinstance(tokenizer, dict):
        tokenizer = tokenizer.get("tokenizer_file") or tokenizer.get("path") or tokenizer.get("vocab_file")
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ConfigError(f"{KEY}.tokenizer is required: a local tokenizer.json or a directory holding one.")
    seq = loader.get("seq_length")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ConfigError(
            f"{KEY}.seq_length must be a positive integer (the model's seq_length); got {seq!r}."
        )
    columns = loader.get("column_names") or ["input_ids", "labels", "loss_mask", "position_ids"]
    if (
        not isinstance(columns, list)
        or not all(c in COLUMNS for c in columns)
        or len(set(columns)) != len(columns)
    ):
        raise ConfigError(
            f"{KEY}.column_names must list distinct columns among {', '.join(COLUMNS)}; got {columns!r}."
        )
    pack = loader.get("pack", "concat")
    if pack not in ("concat", "whole"):
        raise ConfigError(
            f"{KEY}.pack must be 'concat' (split documents across samples, for pre-training) or 'whole' "
            f"(never split a document, pad instead, for SFT); got {pack!r}."
        )
    template = loader.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ConfigError(
            f"{KEY}.chat_template must be a Jinja template string or 'chatml'; got {template!r}."
        )
    template = BUILTIN_TEMPLATES.get(template, template) if template else None
    if template:
        from .text_format import compile_template

        try:
            compiled = compile_template(template)
        except Exception as exc:  # jinja2's TemplateSyntaxError
            raise ConfigError(f"{KEY}.chat_template is not a valid Jinja template: {exc}") from None
        _probe_template(compiled)
    pad_length = loader.get("eod_pad_length", 128)
    if isinstance(pad_length, bool) or not isinstance(pad_length, int) or pad_length < 1:
        raise ConfigError(f"{KEY}.eod_pad_length must be a positive integer; got {pad_length!r}.")
    for name in ("eod", "pad"):
        value = loader.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{KEY}.{name} must be a token id (an integer >= 0); got {value!r}.")
    return {
        "blend": blend,
        "valid": valid,
        "tokenizer": tokenizer,
        "columns": columns,
        "pack": pack,
        "template": template,
        "eod_pad_length": pad_length,
    }


def _check_validation_keys(loader: dict[str, Any]) -> tuple[list[str], float]:
    """``valid_data_path`` (the validation set's own files) or ``validation_split`` (a share of
    ``data_path``'s documents held out of training), at most one of them."""
    paths, split = loader.get("valid_data_path"), loader.get("validation_split")
    if paths is not None and split is not None:
        raise ConfigError(
            f"{KEY}.valid_data_path and {KEY}.validation_split are both set; give the validation set its "
            "own files (valid_data_path) or hold a share of data_path out for it (validation_split), not both."
        )
    if split is not None and (
        isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 < split < 1
    ):
        raise ConfigError(
            f"{KEY}.validation_split must be a fraction between 0 and 1 (e.g. 0.05: one document in 20 of "
            f"data_path is held out of training for validation); got {split!r}."
        )
    if paths is None:
        return [], float(split or 0.0)
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(
            f"{KEY}.valid_data_path must be a list of files / globs / save_to_disk directories (the validation "
            f"set, read in full at every evaluation); got {paths!r}."
        )
    return list(paths), 0.0


def _probe_template(compiled: Any) -> None:
    """Render a two-turn conversation now, so that a template the sandbox refuses is found at load
    (``lmforge check``), not by the loader's workers after the model is built."""
    from .text_format import SANDBOX_REFUSAL, render_template

    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        render_template(compiled, messages=probe, add_generation_prompt=False, bos_token="", eos_token="")
    except DataError as exc:
        if SANDBOX_REFUSAL in str(exc):
            raise ConfigError(f"{KEY}.chat_template: {exc}") from None
        # other template errors depend on the conversation: they are reported with the row that fails


def text_seq_length(loader: dict[str, Any], seq_length: int | None) -> int:
    """The loader's sequence length: its own ``seq_length`` or else the model's, which must agree."""
    seq = loader.get("seq_length", seq_length)
    if seq is None:
        raise ConfigError(f"{KEY}.seq_length must be a positive integer (the model's seq_length); got None.")
    if seq_length is not None and seq != seq_length:
        raise ConfigError(f"{KEY}.seq_length ({seq}) must equal model.seq_length ({seq_length}).")
    return seq


def parse_text_loader(
    loader: dict[str, Any],
    *,
    seq_length: int | None = None,
    vocab_size: int | None = None,
    read_files: bool = True,
) -> TextLoaderSettings | None:
    """Validate the dataloader mapping of a TextDataLoader against the model's ``seq_length``. With
    ``read_files=False`` nothing is read: the tokenizer and the data are checked when the loader is built."""
    parsed = check_text_loader(loader)
    seq = text_seq_length(loader, seq_length)
    blend, tokenizer, columns = parsed["blend"], parsed["tokenizer"], parsed["columns"]
    pack, template, pad_length = parsed["pack"], parsed["template"], parsed["eod_pad_length"]
    if not read_files:
        return None
    from lmforge.utils.tokenizer import find_eod_id, load_tokenizer

    tok = load_tokenizer(tokenizer)
    eod = loader.get("eod")
    if eod is None:
        eod = find_eod_id(tok, tokenizer)
    pad = loader.get("pad", eod)
    vocab = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    for name, value in (("eod", eod), ("pad", pad)):
        if value >= vocab:
            raise ConfigError(f"{KEY}.{name} must be a token id in 0 .. {vocab - 1}; got {value!r}.")
    default_template, bos, eos = tokenizer_chat_template(tokenizer)
    template = template or default_template
    fmt = FormatSettings(
        text_key=_str(loader, "text_key", "text"),
        messages_key=_str(loader, "messages_key", "messages"),
        prompt_key=_str(loader, "prompt_key", "prompt"),
        response_key=_str(loader, "response_key", "response"),
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
        eod=int(eod),
    )
    for path in blend.prefixes:
        TextSource(path, f"{KEY}.data_path")  # the files exist and have a known format
    valid_paths, validation_split = parsed["valid"]
    for path in valid_paths:
        TextSource(path, f"{KEY}.valid_data_path")
    return TextLoaderSettings(
        paths=blend.prefixes,
        weights=blend.weights or [1.0 / len(blend.prefixes)] * len(blend.prefixes),
        valid_paths=valid_paths,
        validation_split=validation_split,
        shuffle_buffer=int(loader.get("shuffle_buffer", DEFAULT_SHUFFLE_BUFFER))
        if loader.get("shuffle")
        else None,
        tokenizer=os.fspath(tokenizer),
        seq_length=seq,
        columns=list(columns),
        pack=pack,
        eod_mask_loss=bool(loader.get("eod_mask_loss", False)),
        eod_pad_length=pad_length,
        format=fmt,
        pad=int(pad),
    )


def blend_choice(weights: list[float], taken: list[int], rows: int) -> int:
    """The source the next row comes from, after ``rows`` rows of which ``taken[i]`` came from source i:
    the one furthest behind its share (``weight * (rows + 1) - taken``)."""
    deficits = [w * (rows + 1) - t for w, t in zip(weights, taken)]
    return int(np.argmax(deficits))


class _SourceStream:
    """Tokenized documents of one source for one rank, from a packing position, epoch after epoch.

    A position's ``doc`` is a place in the epoch's order of the source's documents: the file order,
    or with ``shuffle`` a permutation of each window of ``shuffle_buffer`` consecutive documents,
    seeded by (seed, epoch, window) — so a resume rebuilds the same order from the position alone.
    Which rank reads a document, and whether it is held out for validation, go by its row index in
    the file, the same in every epoch."""

    def __init__(
        self,
        source: TextSource,
        dp_rank: int,
        dp_size: int,
        pool: Any,
        local: RowFormatter | None,
        ahead: int,
        held_out_share: float = 0.0,
        shuffle: tuple[int, int] | None = None,
    ):
        self.source, self.dp_rank, self.dp_size = source, dp_rank, dp_size
        self.pool, self.local, self.ahead = pool, local, ahead
        self.held_out_share = held_out_share  # validation_split: these documents are never trained on
        self.shuffle = shuffle  # (seed, window) or None

    def _ordered(self, epoch: int, start: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """``(place in the epoch's order, row index, row)`` from place ``start`` on."""
        if self.shuffle is None:
            first = start + (self.dp_rank - start) % self.dp_size  # the first row this rank reads
            for index, row in self.source.rows(first):
                yield index, index, row
            return
        seed, window = self.shuffle
        base = start - start % window
        buffer: list[tuple[int, dict[str, Any]]] = []

        def emit() -> Iterator[tuple[int, int, dict[str, Any]]]:
            order = np.random.default_rng([seed, epoch, base // window]).permutation(len(buffer))
            for j, i in enumerate(order):
                if base + j >= start:
                    yield base + j, *buffer[i]

        for index, row in self.source.rows(base):
            buffer.append((index, row))
            if len(buffer) == window:
                yield from emit()
                base, buffer = base + window, []
        if buffer:
            yield from emit()

    def _chunks(self, epoch: int, start: int) -> Iterator[tuple[list[int], list[tuple[int, dict[str, Any]]]]]:
        places: list[int] = []
        chunk: list[tuple[int, dict[str, Any]]] = []
        for place, index, row in self._ordered(epoch, start):
            if index % self.dp_size != self.dp_rank:
                continue
            if self.held_out_share and held_out(index, self.held_out_share):
                continue
            places.append(place)
            chunk.append((index, row))
            if len(chunk) == CHUNK_DOCUMENTS:
                yield places, chunk
                places, chunk = [], []
        if chunk:
            yield places, chunk

    def _locations(self, chunk: list[tuple[int, dict[str, Any]]]) -> list[str]:
        return [self.source.where(index) for index, _ in chunk]  # file:line, for refusals of bad values

    def _encoded(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        name = self.source.path
        if self.pool is None:
            for places, chunk in self._chunks(epoch, start):
                encoded = self.local.encode_rows(chunk, name, self._locations(chunk))
                for place, (_, ids, mask) in zip(places, encoded):
                    yield place, ids, mask
            return
        pending: collections.deque = collections.deque()
        for places, chunk in self._chunks(epoch, start):
            task = (chunk, name, self._locations(chunk))
            pending.append((places, self.pool.apply_async(encode_in_worker, (task,))))
            if len(pending) >= self.ahead:
                places_done, result = pending.popleft()
                yield from ((p, ids, mask) for p, (_, ids, mask) in zip(places_done, result.get()))
        while pending:
            places_done, result = pending.popleft()
            yield from ((p, ids, mask) for p, (_, ids, mask) in zip(places_done, result.get()))

    def __call__(self, position: PackPosition) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        epoch, start = position.epoch, position.doc
        while True:
            found = False
            for place, ids, mask in self._encoded(epoch, start):
                found = True
                yield epoch, place, ids, mask
            if not found and start == 0:
                raise DataError(
                    f"{self.source.path} has no document for data-parallel rank {self.dp_rank} of {self.dp_size}."
                )
            epoch, start = epoch + 1, 0


class TextDataLoader:
    """The training loader of a ``TextDataLoader`` section (an endless stream of micro-batches)."""

    def __init__(
        self,
        settings: TextLoaderSettings,
        *,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        num_workers: int = 0,
        consumed_samples: int = 0,
        seed: int = 0,
    ) -> None:
        self.s = settings
        self.seed = seed  # training.seed: the shuffle's permutations
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_workers = num_workers
        self.consumed_samples = consumed_samples
        self.rows = 0  # rows this rank has produced
        self.taken = [0] * len(settings.paths)
        self.positions = [PackPosition() for _ in settings.paths]
        self._restored = consumed_samples == 0
        self._packers: list[Packer] | None = None
        self._pool: Any = None
        self.sources = [TextSource(p, f"{KEY}.data_path") for p in settings.paths]

    # -- the pipeline -------------------------------------------------------------------------
    def _start(self) -> None:
        if not self._restored:
            raise DataError(
                f"{TEXT_TYPE} cannot resume at sample {self.consumed_samples} without its recorded position "
                "(the checkpoint was written with a different data-parallel layout, or has no data state); "
                "resume with the same number of data-parallel ranks, or start without checkpoint.load_path."
            )
        local = None
        if self.num_workers > 1:
            # Not fork: the training process has threads (checkpoint writers, loggers) whose locks a
            # forked child would inherit held. The fork server starts clean, imports the tokenization
            # module once and forks the workers from there.
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if "forkserver" in methods:
                ctx.set_forkserver_preload(["lmforge.data.text_format"])
            self._pool = ctx.Pool(self.num_workers, init_worker, (self.s.tokenizer, self.s.format))
        else:
            from lmforge.utils.tokenizer import load_tokenizer

            local = RowFormatter(load_tokenizer(self.s.tokenizer), self.s.format)
        ahead = max(2 * self.num_workers, 2)
        self._packers = [
            Packer(
                _SourceStream(
                    src,
                    self.dp_rank,
                    self.dp_size,
                    self._pool,
                    local,
                    ahead,
                    self.s.validation_split,
                    shuffle=None if self.s.shuffle_buffer is None else (self.seed, self.s.shuffle_buffer),
                ),
                self.s.seq_length,
                strategy=self.s.pack,
                pad=self.s.pad,
                position=PackPosition(**pos.to_dict()),
            )
            for src, pos in zip(self.sources, self.positions)
        ]

    def _next_source(self) -> int:
        return blend_choice(self.s.weights, self.taken, self.rows)

    def __iter__(self) -> TextDataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._packers is None:
            self._start()
        rows = []
        for _ in range(self.local_batch_size):
            i = self._next_source()
            packer = self._packers[i]
            row = packer.next_row()
            self.positions[i] = PackPosition(**packer.position.to_dict())
            self.taken[i] += 1
            self.rows += 1
            rows.append(
                row_columns(
                    row,
                    self.s.columns,
                    eod=self.s.format.eod,
                    eod_mask_loss=self.s.eod_mask_loss,
                    eod_pad_length=self.s.eod_pad_length,
                )
            )
        self.consumed_samples += self.local_batch_size * self.dp_size
        return collate({c: np.stack([r[c] for r in rows]) for c in self.s.columns})

    @property
    def epoch(self) -> int:
        """The pass over the data of the rows this rank served last, 1-based (with several sources:
        the one furthest behind; every source has been read completely ``epoch - 1`` times)."""
        if self._packers is None:
            return min(p.epoch for p in self.positions) + 1
        placed = [p.placed_epoch if p.placed_epoch is not None else p.position.epoch for p in self._packers]
        return min(placed) + 1

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "text": {
                "dp_size": self.dp_size,
                "rows": self.rows,
                "taken": list(self.taken),
                "positions": [p.to_dict() for p in self.positions],
                "paths": list(self.s.paths),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        text = state.get("text")
        if not text or text.get("dp_size") != self.dp_size or text.get("paths") != list(self.s.paths):
            return  # _start raises the clear error if a position was needed
        self.close()
        self.consumed_samples = int(state["consumed_samples"])
        self.rows = int(text["rows"])
        self.taken = [int(t) for t in text["taken"]]
        self.positions = [PackPosition(**p) for p in text["positions"]]
        self._restored = True
        self._packers = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
        self._packers = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn the pool down
            self.close()
