"""A readable summary of one indexed dataset (``lmforge data inspect``)."""

from __future__ import annotations

import numpy as np

from lmforge.errors import DataError

from .indexed import IndexedDataset


def length_histogram(lengths: np.ndarray, bins: int = 8) -> list[tuple[int, int, int]]:
    """(low, high, count) rows over power-of-two-ish edges spanning the lengths (inclusive-exclusive)."""
    if len(lengths) == 0:
        return []
    low, high = int(lengths.min()), int(lengths.max())
    if low == high:
        return [(low, high + 1, len(lengths))]
    edges = np.unique(np.geomspace(max(low, 1), high + 1, bins + 1).astype(np.int64))
    edges[0] = min(edges[0], low)
    edges[-1] = high + 1
    counts, _ = np.histogram(lengths, bins=edges)
    return [(int(a), int(b), int(c)) for a, b, c in zip(edges[:-1], edges[1:], counts)]


def describe(prefix: str, tokenizer_path: str | None = None, sample_tokens: int = 64, width: int = 40) -> str:
    ds = IndexedDataset(prefix)
    largest = ds.max_token()  # one read of the .bin, for the statistics and the tokenizer's check
    doc_lengths = np.diff(
        np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])[ds.document_indices]
    )
    lines = [
        f"dataset     {ds.prefix}.{{bin,idx}}",
        f"dtype       {ds.dtype.name}",
        f"documents   {ds.num_documents:,}",
        f"sequences   {len(ds):,}",
        f"tokens      {ds.num_tokens:,}",
    ]
    if len(doc_lengths):
        lines.append(
            f"doc length  min {int(doc_lengths.min()):,}  mean {float(doc_lengths.mean()):,.1f}  "
            f"median {int(np.median(doc_lengths)):,}  max {int(doc_lengths.max()):,}"
        )
        lines.append(f"max token   {largest:,}")
        lines.append("length histogram (tokens per document):")
        rows = length_histogram(doc_lengths)
        peak = max(c for _, _, c in rows) or 1
        for low, high, count in rows:
            bar = "#" * max(1 if count else 0, round(width * count / peak))
            lines.append(f"  {low:>8,} - {high - 1:<8,} {count:>8,}  {bar}")
    if tokenizer_path is not None and ds.num_documents:
        from lmforge.utils.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if largest >= vocab:
            # decode() drops ids it does not know: the sample used to print as a few '<unk>'s, silently.
            raise DataError(
                f"{ds.prefix}.bin holds token id {largest:,}, but --tokenizer {tokenizer_path} has {vocab:,} ids "
                f"(0 .. {vocab - 1:,}): it is not the tokenizer the data was made with. Give that one, or drop "
                "--tokenizer to see the statistics."
            )
        ids = ds.document(0)[:sample_tokens].tolist()
        lines.append(f"document 0, first {len(ids)} tokens: {ids}")
        lines.append("decoded: " + repr(tokenizer.decode(ids, skip_special_tokens=False)))
    return "\n".join(lines)
