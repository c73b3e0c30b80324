"""GPTDataset: fixed-length causal-LM samples cut across documents, in Megatron's order.

A sample is ``seq_length + 1`` consecutive tokens of the shuffled, epoch-repeated document stream
(the last token is shared with the next sample); ``input_ids = text[:-1]``, ``labels = text[1:]``.
Masks and position ids follow Megatron's ``_get_ltor_masks_and_position_ids`` and MindSpore
Transformers' compressed EOD mask (``actual_seq_len``).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from lmforge.errors import DataError
from lmforge.utils.logging import get_logger

from .config import CONFIG_PATH, GPTDatasetConfig
from .indexed import IndexedDataset
from .indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    num_epochs_for,
    separate_final_epoch,
)

SPLIT_NAMES = ("train", "valid", "test")
log = get_logger("lmforge.data")


def default_cache_dir(prefix: str) -> str:
    """Megatron's default: ``<dir of the prefix>/cache/GPTDataset_indices``."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


class IndexCache:
    """Index arrays kept as ``<dir>/<md5 of description>-<kind>-<split>-<name>.npy``.

    Writes are atomic (temp file + rename) so ranks that build the same arrays at once never see a
    partial file. The default directory beside the data falls back to keeping the arrays in memory when
    it cannot be written (read-only shared data); one the user named (``path_to_cache``) is an error
    instead (``files.cache_dir_problem`` refuses the usual cases before anything is built).
    """

    def __init__(
        self, config: GPTDatasetConfig, prefix: str, kind: str, split: str, description: dict
    ) -> None:
        self.description = json.dumps(description, indent=2, sort_keys=True)
        digest = hashlib.md5(self.description.encode("utf-8"), usedforsecurity=False).hexdigest()
        self.directory = config.path_to_cache or default_cache_dir(prefix)
        self.named_by_user = config.path_to_cache is not None
        self.stem = os.path.join(self.directory, f"{digest}-{kind}-{split}")

    def path(self, name: str) -> str:
        return f"{self.stem}-{name}.npy"

    def load(self, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
        if not all(os.path.isfile(self.path(n)) for n in names):
            return None
        try:
            return {n: np.load(self.path(n), mmap_mode="r", allow_pickle=False) for n in names}
        except (OSError, ValueError):
            return None  # a damaged cache entry is rebuilt

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            for name, array in arrays.items():
                tmp = f"{self.path(name)}.{os.getpid()}.tmp.npy"
                np.save(tmp, array, allow_pickle=False)
                os.replace(tmp, self.path(name))
            desc = f"{self.stem}-description.txt"
            with open(f"{desc}.{os.getpid()}.tmp", "w") as f:
                f.write(self.description)
            os.replace(f"{desc}.{os.getpid()}.tmp", desc)
        except OSError as exc:
            if self.named_by_user:
                raise DataError(
                    f"{CONFIG_PATH}.path_to_cache: cannot write the dataset index cache in {self.directory} "
                    f"({exc}). Point path_to_cache at a writable directory with room for the index arrays, or "
                    "remove it to cache beside the data."
                ) from None
            log.warning(
                "cannot write the dataset index cache in %s (%s); keeping it in memory", self.directory, exc
            )


class GPTDataset:
    """Samples of one split of one indexed dataset; ``dataset[k]`` is a dict of numpy arrays."""

    def __init__(
        self,
        indexed: IndexedDataset,
        sequence_ids: np.ndarray,
        num_samples: int | None,
        split: int,
        config: GPTDatasetConfig,
    ) -> None:
        self.indexed = indexed
        self.sequence_ids = sequence_ids
        self.num_samples = num_samples
        self.split = split
        self.config = config
        if len(sequence_ids) == 0:
            raise DataError(
                f"the {SPLIT_NAMES[split]} split of {indexed.prefix} holds no sequences "
                f"({len(indexed)} in the file); change train_dataset.dataloader.config.split or use more data."
            )
        self._build_indices()
        if len(self) < 1:
            raise DataError(
                f"{indexed.prefix} ({SPLIT_NAMES[split]} split) has {self.tokens_per_epoch} tokens, too few "
                f"for one sample of seq_length {config.seq_length} + {config.extra_token}."
            )
        if num_samples is not None and len(self) < num_samples:  # pragma: no cover - guaranteed by epochs
            raise DataError(
                f"{indexed.prefix}: built {len(self)} samples, fewer than the {num_samples} requested"
            )
        self._cached_masks: dict[str, np.ndarray] | None = None

    # -- indices ----------------------------------------------------------------------------
    def _build_indices(self) -> None:
        cfg = self.config
        sizes = self.indexed.sequence_lengths
        self.tokens_per_epoch = int(sizes[self.sequence_ids].sum(dtype=np.int64))
        x = cfg.extra_token
        drop_last = True if self.split != 1 else cfg.drop_last_partial_validation_sequence
        description = {
            "class": "GPTDataset",
            "dataset_path": os.path.abspath(self.indexed.prefix),
            "index_split": SPLIT_NAMES[self.split],
            "sequence_ids": [int(self.sequence_ids[0]), int(self.sequence_ids[-1]) + 1],
            "num_samples": self.num_samples,
            "random_seed": cfg.seed,
            "sequence_length": cfg.seq_length,
            "add_extra_token_to_sequence": cfg.add_extra_token_to_sequence,
            "drop_last_partial_sequence": drop_last,
            "idx_size": os.path.getsize(f"{self.indexed.prefix}.idx"),
            "idx_mtime_ns": os.stat(f"{self.indexed.prefix}.idx").st_mtime_ns,
        }
        cache = IndexCache(cfg, self.indexed.prefix, "GPTDataset", SPLIT_NAMES[self.split], description)
        names = ("document_index", "sample_index", "shuffle_index")
        arrays = cache.load(names)
        if arrays is None:
            epochs = num_epochs_for(self.tokens_per_epoch, self.num_samples, cfg.seq_length, x)
            separate, sans_final = separate_final_epoch(
                self.tokens_per_epoch, epochs, self.num_samples, cfg.seq_length, x
            )
            rng = np.random.RandomState(cfg.seed)
            document_index = build_document_index(self.sequence_ids, epochs, rng, separate)
            sample_index = build_sample_index(
                sizes, document_index, cfg.seq_length, epochs, self.tokens_per_epoch, drop_last, x
            )
            total = sample_index.shape[0] - 1
            shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
            arrays = {
                "document_index": document_index,
                "sample_index": sample_index,
                "shuffle_index": shuffle_index,
            }
            cache.save(arrays)
        # Plain ndarray views: indexing a np.memmap element by element is several times slower.
        self.document_index = arrays["document_index"].view(np.ndarray)
        self.sample_index = arrays["sample_index"].view(np.ndarray)
        self.shuffle_index = arrays["shuffle_index"].view(np.ndarray)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    # -- samples ----------------------------------------------------------------------------
    def text(self, k: int) -> np.ndarray:
        """The ``seq_length + extra`` raw tokens of sample ``k`` (after the shuffle), right-padded."""
        return self._text(k)[0]

    def _pieces(self, k: int) -> list[np.ndarray]:
        """Views on the memory map whose concatenation is sample ``k``'s text (unpadded)."""
        j = int(self.shuffle_index[k])
        (doc_first, off_first), (doc_last, off_last) = self.sample_index[j : j + 2].tolist()
        x = self.config.extra_token
        seqs = self.document_index[doc_first : doc_last + 1]
        starts = self.indexed.token_offsets[seqs].tolist()
        tokens = self.indexed.tokens
        if doc_first == doc_last:
            return [tokens[starts[0] + off_first : starts[0] + off_last + x]]
        lengths = self.indexed.sequence_lengths[seqs].tolist()
        pieces = [tokens[starts[0] + off_first : starts[0] + lengths[0]]]
        pieces.extend(tokens[s : s + n] for s, n in zip(starts[1:-1], lengths[1:-1]))
        pieces.append(tokens[starts[-1] : starts[-1] + off_last + x])
        return pieces

    def _text(self, k: int) -> tuple[np.ndarray, bool]:
        want = self.config.seq_length + self.config.extra_token
        text = np.empty(want, dtype=np.int64)
        filled = copy_range(self._pieces(k), text, 0)
        if filled < want:  # the last, partial validation sample
            text[filled:] = self.config.pad
        return text, filled < want

    def fill_row(self, k: int | None, batch: dict[str, np.ndarray], row: int) -> None:
        """Write sample ``k`` into row ``row`` of preallocated batch arrays (the loader's fast path).

        ``batch`` holds ``input_ids`` and ``labels`` (int64 [B, S]) and a scratch ``_text`` (int64
        [B, S + extra]); ``loss_mask`` must come
        pre-filled with ones and ``position_ids`` with ``arange(S)``; other columns are optional.
        Same values as ``self[k]`` without the per-sample arrays and the stacking copy.
        """
        cfg = self.config
        seq = cfg.seq_length
        tokens, labels = batch["input_ids"][row], batch["labels"][row]
        # One walk over the pieces into a scratch row (converting to int64 once), then two memcpys.
        text = batch["_text"][row]
        filled = copy_range(self._pieces(0 if k is None else k), text, 0)
        padded = filled < len(text)
        if padded:
            text[filled:] = cfg.pad
        tokens[:] = text[:seq]
        if cfg.add_extra_token_to_sequence:
            labels[:] = text[1:]
        else:
            labels[:-1] = text[1:]
            labels[-1] = cfg.pad
        may_hold_pad = cfg.pad >= 0 or not cfg.add_extra_token_to_sequence or padded
        plain = not (
            cfg.eod_mask_loss
            or cfg.reset_position_ids
            or "attention_mask" in batch
            or "actual_seq_len" in batch
        )
        if plain and not may_hold_pad:
            pass  # loss_mask = 1 and position_ids = arange, as pre-filled
        else:
            sample = make_sample_columns(tokens, labels, cfg, may_hold_pad)  # edits tokens/labels in place
            for name, value in sample.items():
                if name in batch and name not in ("input_ids", "labels"):
                    batch[name][row] = value
        if k is None:
            batch["loss_mask"][row] = 0.0

    def __getitem__(self, k: int | None) -> dict[str, np.ndarray]:
        """One sample. ``k=None`` is a padding sample: sample 0 with an all-zero loss mask."""
        cfg = self.config
        text, padded = self._text(0 if k is None else k)
        # Token ids are >= 0, so a pad of -1 can only come from padding (a short sample or the
        # rolled label); a real pad id (>= 0) may occur anywhere.
        may_hold_pad = cfg.pad >= 0 or not cfg.add_extra_token_to_sequence or padded
        if cfg.add_extra_token_to_sequence:
            # Views of one buffer unless the padding pass will write to them.
            tokens, labels = text[:-1], text[1:]
            if may_hold_pad:
                tokens, labels = tokens.copy(), labels.copy()
        else:
            tokens, labels = text, np.roll(text, -1)
            labels[-1] = cfg.pad
        sample = make_sample_columns(tokens, labels, cfg, may_hold_pad)
        if k is None:
            sample["loss_mask"][:] = 0.0
        return sample


def copy_range(pieces: list[np.ndarray], out: np.ndarray, start: int) -> int:
    """Copy text positions ``[start, start + len(out))`` of the concatenated pieces into ``out``.

    Returns how many positions were filled (fewer than ``len(out)`` only at the end of the text).
    Each token is converted to ``out``'s dtype exactly once, straight from the memory map.
    """
    n = len(out)
    pos = filled = 0
    for piece in pieces:
        end = pos + len(piece)
        lo, hi = max(pos, start), min(end, start + n)
        if lo < hi:
            out[lo - start : hi - start] = piece[lo - pos : hi - pos]
            filled = hi - start
        pos = end
        if pos >= start + n:
            break
    return filled


def make_sample_columns(
    tokens: np.ndarray, labels: np.ndarray, cfg: GPTDatasetConfig, may_hold_pad: bool = True
) -> dict[str, np.ndarray]:
    """input_ids, labels, loss_mask, position_ids and attention_mask / actual_seq_len of one sample.

    ``may_hold_pad=False`` skips the padding pass when the caller knows no pad id can occur.
    """
    seq = len(tokens)
    loss_mask = np.ones(seq, dtype=np.float32)
    need_eod = cfg.eod >= 0 and (
        cfg.eod_mask_loss
        or cfg.reset_position_ids
        or cfg.reset_attention_mask
        or cfg.create_compressed_eod_mask
    )
    is_eod = tokens == cfg.eod if need_eod else None
    if cfg.eod_mask_loss and is_eod is not None:
        # Masks the prediction made *from* an EOD (the next document's first token); predicting
        # the EOD itself is still trained. Megatron's choice, kept for the same loss.
        loss_mask[is_eod] = 0.0
    segment = None
    if is_eod is not None and (cfg.reset_position_ids or cfg.reset_attention_mask) and seq:
        # Document id of every position: a new document starts right after each EOD.
        segment = np.concatenate([[0], np.cumsum(is_eod[:-1])])
    if cfg.reset_position_ids and segment is not None:
        starts = np.flatnonzero(np.concatenate([[True], segment[1:] != segment[:-1]]))
        position_ids = np.arange(seq, dtype=np.int64) - starts[segment]
    else:
        position_ids = _arange(seq)
    out = {"input_ids": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if cfg.create_compressed_eod_mask:
        out["actual_seq_len"] = actual_seq_len(
            is_eod if is_eod is not None else np.zeros(seq, dtype=bool), cfg.eod_pad_length
        )
    elif cfg.create_attention_mask:
        causal = np.tril(np.ones((seq, seq), dtype=bool))
        if cfg.reset_attention_mask and segment is not None:
            causal &= segment[:, None] == segment[None, :]
        out["attention_mask"] = ~causal[None]  # True = masked, as Megatron and MindSpore Transformers
    if may_hold_pad:
        loss_mask[labels == cfg.pad] = 0.0
        tokens[tokens == cfg.pad] = 0  # padding ids must still be valid embedding rows
        labels[labels == cfg.pad] = 0
    return out


_ARANGES: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    """A shared read-only ``arange(n)`` (position ids without resets are the same for every sample)."""
    if n not in _ARANGES:
        array = np.arange(n, dtype=np.int64)
        array.flags.writeable = False
        _ARANGES[n] = array
    return _ARANGES[n]


def actual_seq_len(is_eod: np.ndarray, pad_length: int) -> np.ndarray:
    """MindSpore Transformers' compressed EOD mask: cumulative document ends, padded with S."""
    seq = len(is_eod)
    ends = np.flatnonzero(is_eod) + 1
    if len(ends) and ends[-1] == seq:
        ends = ends[:-1]  # the sample's own end is always appended as padding
    if len(ends) > pad_length:
        raise DataError(
            f"Number of EOD tokens ({len(ends)}) exceeds compressed_eod_mask_length ({pad_length}). "
            "Raise train_dataset.dataloader.config.eod_pad_length."
        )
    out = np.full(pad_length, seq, dtype=np.int64)
    out[: len(ends)] = ends
    return out
