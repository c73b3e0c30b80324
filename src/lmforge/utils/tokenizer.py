"""Local Hugging Face ``tokenizer.json`` files (never fetched from a hub)."""

from __future__ import annotations

import json
import os
from typing import Any

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


MAX_CONFIG_BYTES = 16 << 20  # tokenizer_config.json files are kilobytes; a chat template is text


def read_tokenizer_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``directory`` ({} when there is none), checked to be a JSON object."""
    path = os.path.join(os.fspath(directory), "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    problem = None
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        problem = (
            f"it is {os.path.getsize(path):,} bytes, more than the {MAX_CONFIG_BYTES:,} such a file needs"
        )
    else:
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                problem = f"it holds {type(config).__name__}, not a JSON object"
        except UnicodeDecodeError as exc:
            problem = f"it is not UTF-8 text ({exc.reason} at byte {exc.start})"
        except (ValueError, RecursionError) as exc:
            problem = f"it is not valid JSON ({str(exc)[:120]})"
    if problem:
        raise DataError(
            f"{path} cannot be read: {problem}. Fix or remove the file (the tokenizer is read from tokenizer.json; "
            "this file only names special tokens and the chat template)."
        )
    return config


def special_token(config: dict[str, Any], name: str) -> str:
    """A special token's text in a tokenizer config: a string, or an object with a string ``content``."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"tokenizer_config.json: {name} must be a string or an object with a string 'content', found "
            f"{type(value).__name__} {str(value)[:40]!r}. Fix the file."
        )
    return value


# How to name the end-of-document token where the caller has no option of its own for it.
EOD_HINT = 'give it as "eos_token" in a tokenizer_config.json next to the tokenizer.json'


def find_eod_id(
    tokenizer, path: str | os.PathLike, eod_token: str | None = None, *, hint: str = EOD_HINT
) -> int:
    """The id appended after each document: ``eod_token``, else the config's eos, else a known name.
    ``hint`` ends the error: how the caller's user names the token (the option or key that sets it)."""
    names: list[str] = []
    if eod_token:
        names = [eod_token]
    else:
        eos = special_token(read_tokenizer_config(os.path.dirname(tokenizer_file(path))), "eos_token")
        if eos:
            names.append(eos)
        names.extend(EOD_CANDIDATES)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise DataError(
        f"cannot find an end-of-document token in {tokenizer_file(path)} (tried {', '.join(names)}); {hint}."
    )
