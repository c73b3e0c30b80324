"""The index arrays behind GPTDataset and BlendedDataset, built as Megatron-Core builds them.

Same inputs give the same arrays as Megatron (its ``helpers.cpp`` and ``gpt_dataset.py``), so a
dataset trains on the same samples in the same order. Reproducing the order bit-exactly needs the
legacy ``numpy.random.RandomState`` (MT19937) and its ``shuffle`` calls in Megatron's order:
document index (one or two calls), then shuffle index (one or two calls).
"""

from __future__ import annotations

import math
import re

import numpy as np

# Megatron separates the final epoch when it contributes fewer than this share of an epoch's
# samples, so the tail does not oversample a random subset of documents.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def parse_split(split: str) -> list[float]:
    """``"98,2,0"`` -> normalised ``[0.98, 0.02, 0.0]`` (numbers found by regex, padded to three)."""
    if re.search(r"-\s*[.0-9]", split):  # the number regex below would drop the sign
        raise ValueError(f"split {split!r} has a negative part")
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    values = (values + [0.0] * 3)[:3]
    total = sum(values)
    if total <= 0:
        raise ValueError(f"split {split!r} has no positive part")
    return [v / total for v in values]


def split_matrix(weights: list[float]) -> list[tuple[float, float] | None]:
    """Cumulative book-ends per split, ``None`` for an empty split."""
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    return [(bounds[i], bounds[i + 1]) if weights[i] > 0 else None for i in range(len(weights))]


def split_sequence_range(bounds: tuple[float, float], num_sequences: int) -> np.ndarray:
    """The contiguous sequence ids of one split (splits are ranges in file order, not random)."""
    beg = int(round(bounds[0] * float(num_sequences)))
    end = int(round(bounds[1] * float(num_sequences)))
    return np.arange(beg, end, dtype=np.int32)


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    """Smallest E with ``E * tokens_per_epoch >= num_samples * seq_length + extra`` (1 when unset)."""
    if num_samples is None or tokens_per_epoch <= 0:
        return 1
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(
    tokens_per_epoch: int, num_epochs: int, num_samples: int | None, seq_length: int, extra: int
) -> tuple[bool, int]:
    """Whether the last epoch is shuffled on its own, and the samples before it."""
    if num_epochs == 1 or num_samples is None:
        return False, 0
    sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), sans_final


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """The split's sequence ids repeated ``num_epochs`` times, shuffled as one (epochs interleave)."""
    if not separate_final or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool = True,
    extra: int = 1,
) -> np.ndarray:
    """``[N + 1, 2]`` rows of (position in document_index, token offset) bracketing each sample.

    Sample j covers the global token range ``[j*S, j*S + S + extra)`` of the concatenated
    documents; row j+1 names where that range ends (minus the extra token, which is shared with
    the next sample). Megatron walks this in C++; the same boundaries follow in closed form from
    the cumulative document lengths, vectorised here.
    """
    total = num_epochs * tokens_per_epoch
    if drop_last_partial:
        num_samples = (total - extra) // seq_length
    else:
        num_samples = math.ceil((total - extra) / seq_length)
    num_samples = max(num_samples, 0)
    lengths = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)  # exclusive end of each document_index entry, in global tokens
    sample_end = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length + extra
    # The entry holding the end is the first one whose cumulative length reaches it (Megatron
    # stops in a document as soon as the remaining need drops to <= 0, skipping nothing).
    doc = np.searchsorted(ends, sample_end, side="left")
    starts = ends - lengths
    last = len(document_index) - 1
    overflow = doc > last  # only the final, padded sample of a partial-sequence split
    doc = np.minimum(doc, last)
    offset = sample_end - extra - starts[doc]
    if overflow.any():
        offset[overflow] = lengths[last] - extra
    largest = max(len(document_index), int(np.max(sizes)) if len(sizes) else 0)
    dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    out[1:, 0] = doc
    out[1:, 1] = offset
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``arange(total_size)`` with ``[0, num_samples)`` and the rest shuffled separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy blending: step t draws from the dataset furthest behind ``w_d * max(t, 1)``.

    Deterministic, no RNG; ties go to the lowest dataset id. Arithmetic is float64 as in Megatron.
    """
    weights = [float(w) for w in weights]
    drawn = [0] * len(weights)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for t in range(size):
        scale = float(max(t, 1))
        best, best_error = 0, -math.inf
        for d, w in enumerate(weights):
            error = w * scale - drawn[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[t] = best
        dataset_sample_index[t] = drawn[best]
        drawn[best] += 1
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Blend in proportion to ``sizes`` until every dataset is used up exactly once."""
    total = int(sum(sizes))
    weights = [s / float(total) for s in sizes] if total else []
    drawn = [0] * len(sizes)
    unspent = [d for d, s in enumerate(sizes) if s > 0]
    dataset_index = np.empty(total, dtype=np.int16)
    dataset_sample_index = np.empty(total, dtype=np.int64)
    for t in range(total):
        scale = float(max(t, 1))
        best, best_error = -1, -math.inf
        for d in unspent:
            error = weights[d] * scale - drawn[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[t] = best
        dataset_sample_index[t] = drawn[best]
        drawn[best] += 1
        if drawn[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, dataset_sample_index
