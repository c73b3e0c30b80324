"""What a ``TextDataLoader`` needs to run, from its typed section plus the files: the tokenizer read
(its end-of-document token and chat template), token ids checked against the vocabulary, and every
source checked to exist with a known format. Built once per loader, after the model is typed."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lmforge.errors import ConfigError

from .text_format import FormatSettings, tokenizer_chat_template
from .text_schema import KEY, TextLoader
from .text_sources import TextSource


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


def text_loader_settings(
    typed: TextLoader, *, seq_length: int | None = None, vocab_size: int | None = None
) -> TextLoaderSettings:
    """The settings of the typed section ``typed`` for a model of ``seq_length`` / ``vocab_size``
    (None: not known; the loader's own seq_length and the tokenizer's vocabulary then decide)."""
    from lmforge.utils.tokenizer import find_eod_id, load_tokenizer

    seq = typed.sequence_length(seq_length)
    tok = load_tokenizer(typed.tokenizer)
    eod = (
        typed.eod
        if typed.eod is not None
        else find_eod_id(tok, typed.tokenizer, hint=f"set {KEY}.eod to its id")
    )
    pad = typed.pad if typed.pad is not None else eod
    vocab = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    for name, value in (("eod", eod), ("pad", pad)):
        if value >= vocab:
            raise ConfigError(f"{KEY}.{name} must be a token id in 0 .. {vocab - 1}; got {value!r}.")
    default_template, bos, eos = tokenizer_chat_template(typed.tokenizer)
    fmt = FormatSettings(
        text_key=typed.text_key,
        messages_key=typed.messages_key,
        prompt_key=typed.prompt_key,
        response_key=typed.response_key,
        chat_template=typed.template or default_template,
        bos_token=bos,
        eos_token=eos,
        eod=int(eod),
    )
    blend = typed.data_path
    for path in blend.prefixes:
        TextSource(path, f"{KEY}.data_path")  # the files exist and have a known format
    valid_paths = typed.valid_data_path or []
    for path in valid_paths:
        TextSource(path, f"{KEY}.valid_data_path")
    return TextLoaderSettings(
        paths=list(blend.prefixes),
        weights=blend.weights or [1.0 / len(blend.prefixes)] * len(blend.prefixes),
        valid_paths=list(valid_paths),
        validation_split=typed.validation_split or 0.0,
        shuffle_buffer=typed.shuffle_buffer if typed.shuffle else None,
        tokenizer=os.fspath(typed.tokenizer),
        seq_length=seq,
        columns=list(typed.column_names),
        pack=typed.pack,
        eod_mask_loss=typed.eod_mask_loss,
        eod_pad_length=typed.eod_pad_length,
        format=fmt,
        pad=int(pad),
    )
