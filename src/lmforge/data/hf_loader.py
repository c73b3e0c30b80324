"""MindSpore Transformers' ``HFDataLoader`` section, translated key by key into a ``TextDataLoader``.

Mapped: ``load_func`` (``load_dataset`` on local files / ``load_from_disk``), ``path``, ``data_files``,
``streaming`` and ``split: train`` (lmforge always streams), ``create_attention_mask``,
``create_compressed_eod_mask``, ``compressed_eod_mask_length``, ``shuffle``, and the handlers
``AlpacaInstructDataHandler`` (instruction / input / output columns, or ``prompt_key``),
``PackingHandler`` (``pack_strategy: pack`` → whole documents, ``truncate`` → concatenated) and
``remove_columns``. ``tokenizer`` (``pretrained_model_dir`` / ``tokenizer_file``) and ``seq_length``
are taken from the loader or its handlers. Everything else is refused by name with the equivalent
``TextDataLoader`` key (docs/data.md lists the table).

The translation is a pre-validation expansion, not a schema of its own: the registered loader schema
(``data/schema.py`` ``text_loader``) runs it once, at load, on the keys the file wrote, and types its
result as a :class:`~lmforge.data.text_schema.TextLoader` (``cfg.train_dataset.dataloader.typed``).
Nothing keeps the HFDataLoader mapping after load or validates it again; everything after reads the
typed ``TextLoader``, so a second schema would only repeat the text loader's keys and checks.
"""

from __future__ import annotations

import os
from typing import Any

from lmforge.errors import ConfigError
from lmforge.utils.logging import get_logger

log = get_logger("lmforge.data")

KEY = "train_dataset.dataloader"
_BUILDERS = ("json", "parquet", "arrow")
_IGNORED = {"use_broadcast_data": "every rank reads its own documents"}


def _tokenizer_of(spec: Any, where: str) -> str | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        for key in ("tokenizer_file", "pretrained_model_dir", "path", "vocab_file"):
            if isinstance(spec.get(key), str):
                return spec[key]
    raise ConfigError(
        f"{where} must name a local tokenizer (pretrained_model_dir or tokenizer_file); got {spec!r}."
    )


def _data_path(loader: dict[str, Any]) -> list[str]:
    func = loader.get("load_func", "load_dataset")
    path, files = loader.get("path"), loader.get("data_files")
    if func == "load_from_disk":
        if not isinstance(path, str):
            raise ConfigError(
                f"{KEY}.path must be the save_to_disk directory with load_func: load_from_disk."
            )
        return [path]
    if func != "load_dataset":
        raise ConfigError(f"{KEY}.load_func must be 'load_dataset' or 'load_from_disk'; got {func!r}.")
    if files is not None:
        if isinstance(files, dict):
            if set(files) != {"train"}:
                raise ConfigError(f"{KEY}.data_files: only a 'train' split is read; got {sorted(files)}.")
            files = files["train"]
        return [files] if isinstance(files, str) else list(files)
    if (
        isinstance(path, str)
        and path not in _BUILDERS
        and (os.path.exists(path) or any(c in path for c in "*?["))
    ):
        return [path]
    raise ConfigError(
        f"{KEY}.path = {path!r}: lmforge reads local data only (no hub downloads). Give data_files (local "
        f".jsonl/.json/.parquet/.arrow files) with path: json / parquet / arrow, or a local path."
    )


def translate_hf_loader(loader: dict[str, Any]) -> dict[str, Any]:
    """The TextDataLoader mapping equivalent to an HFDataLoader mapping (ConfigError if there is none)."""
    out: dict[str, Any] = {"type": "TextDataLoader", "data_path": _data_path(loader)}
    seq_length = loader.get("seq_length")
    tokenizer = _tokenizer_of(loader.get("tokenizer"), f"{KEY}.tokenizer")
    columns = ["input_ids", "labels", "loss_mask", "position_ids"]
    unsupported: list[str] = []  # every key without an equivalent, named at once
    for key, value in loader.items():
        if key in ("type", "load_func", "path", "data_files", "seq_length", "tokenizer", "handler"):
            continue
        if key in ("streaming", "split"):
            if key == "split" and value not in (None, "train"):
                raise ConfigError(f"{KEY}.split: only the 'train' split is read; got {value!r}.")
            continue
        if key == "shuffle":
            out["shuffle"] = value  # TextDataLoader shuffles within windows of shuffle_buffer documents
        elif key == "create_attention_mask":
            if value:
                columns.append("attention_mask")
        elif key == "create_compressed_eod_mask":
            if value:
                columns = [c for c in columns if c != "attention_mask"] + ["actual_seq_len"]
        elif key == "compressed_eod_mask_length":
            out["eod_pad_length"] = value
        elif key in _IGNORED:
            log.warning("%s.%s has no effect in lmforge: %s", KEY, key, _IGNORED[key])
        elif key in (
            "column_names",
            "text_key",
            "messages_key",
            "prompt_key",
            "response_key",
            "chat_template",
            "shuffle_buffer",
            "valid_data_path",  # lmforge's validation set keys, as for TextDataLoader
            "validation_split",
        ):
            out[key] = value
        else:
            unsupported.append(key)
    if unsupported:
        verb = "has" if len(unsupported) == 1 else "have"
        raise ConfigError(
            f"{', '.join(f'{KEY}.{k}' for k in unsupported)} of HFDataLoader {verb} no equivalent in lmforge. "
            "Supported HFDataLoader keys: load_func, path, data_files, streaming, split, shuffle, shuffle_buffer, "
            "valid_data_path, validation_split, "
            "create_attention_mask, create_compressed_eod_mask, compressed_eod_mask_length, use_broadcast_data, "
            "tokenizer, seq_length, handler; or write the section as type: TextDataLoader (docs/data.md)."
        )
    handlers = loader.get("handler") or []
    if not isinstance(handlers, list):
        raise ConfigError(f"{KEY}.handler must be a list of handler mappings; got {handlers!r}.")
    for i, h in enumerate(handlers):
        where = f"{KEY}.handler[{i}]"
        kind = h.get("type") if isinstance(h, dict) else None
        if kind == "AlpacaInstructDataHandler":
            tokenizer = _tokenizer_of(h.get("tokenizer"), f"{where}.tokenizer") or tokenizer
            seq_length = h.get("seq_length", seq_length)
            if isinstance(h.get("prompt_key"), str) and h["prompt_key"] != "conversations":
                out["prompt_key"] = h["prompt_key"]
            out.setdefault("pack", "whole")
        elif kind == "PackingHandler":
            seq_length = h.get("seq_length", seq_length)
            strategy = h.get("pack_strategy", "pack")
            if strategy not in ("pack", "truncate"):
                raise ConfigError(f"{where}.pack_strategy must be 'pack' or 'truncate'; got {strategy!r}.")
            out["pack"] = "whole" if strategy == "pack" else "concat"
            if "actual_seq_len" in (h.get("output_columns") or []) and "actual_seq_len" not in columns:
                columns = [c for c in columns if c != "attention_mask"] + ["actual_seq_len"]
        elif kind == "remove_columns":
            continue  # only the columns a row format needs are read anyway
        else:
            raise ConfigError(
                f"{where}.type = {kind!r} has no equivalent in lmforge. Supported handlers: "
                "AlpacaInstructDataHandler (prompt/response SFT), PackingHandler, remove_columns; other "
                "formatting goes into the data files (text / messages / prompt+response columns)."
            )
    out.setdefault("column_names", columns)
    if tokenizer is not None:
        out["tokenizer"] = tokenizer
    if seq_length is not None:
        out["seq_length"] = seq_length
    return out
