"""Local Hugging Face ``tokenizer.json`` files (never fetched from a hub)."""

from __future__ import annotations

import json
import os

from lmforge.errors import DataError

# Tried in order when neither the caller nor tokenizer_config.json names the end-of-document token.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")


def tokenizer_file(path: str | os.PathLike) -> str:
    """``path`` itself when it is a file, else ``path/tokenizer.json``."""
    path = os.fspath(path)
    candidate = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise DataError(
            f"no tokenizer at '{path}': give a Hugging Face tokenizer.json file or a directory holding one "
            "(hub names are not downloaded; save the tokenizer locally first)."
        )
    return candidate


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json (or a directory holding one)."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # the Rust library raises plain Exceptions with its parse error
        raise DataError(f"{file} is not a valid Hugging Face tokenizer.json: {exc}") from None


def find_eod_id(tokenizer, path: str | os.PathLike, eod_token: str | None = None) -> int:
    """The id appended after each document: ``eod_token``, else the config's eos, else a known name."""
    names: list[str] = []
    if eod_token:
        names = [eod_token]
    else:
        config = os.path.join(os.path.dirname(tokenizer_file(path)), "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        names.extend(EOD_CANDIDATES)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise DataError(
        f"cannot find an end-of-document token in {tokenizer_file(path)} (tried {', '.join(names)}); "
        "name it with --eod-token."
    )
