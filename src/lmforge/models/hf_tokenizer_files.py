"""The tokenizer half of a Hugging Face export: tokenizer.json, tokenizer_config.json (with the chat
template), special_tokens_map.json and generation_config.json, so ``AutoTokenizer`` and ``generate``
work on the exported directory.

Files the source tokenizer directory already has are copied (a Hub tokenizer keeps its own chat
template and special tokens); what is missing is written from what ``tokenizer.json`` itself says
(end-of-document token as lmforge's data pipeline finds it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from lmforge.data.tokenizer import find_eod_id, load_tokenizer, tokenizer_file
from lmforge.errors import DataError

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Everything of a Hugging Face directory that belongs to the tokenizer side (copied on import).
TOKENIZER_FILES = (
    "tokenizer.json",
    TOKENIZER_CONFIG,
    SPECIAL_TOKENS_MAP,
    GENERATION_CONFIG,
    CHAT_TEMPLATE_FILE,
)
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken mapping."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{file} is not a readable JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{file} must hold a JSON object, got {type(data).__name__}.")
    return data


def _source_template(config: dict[str, Any], src_dir: Path) -> str | None:
    """The source tokenizer's own chat template: tokenizer_config.json's, else chat_template.jinja."""
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if template is None and (src_dir / CHAT_TEMPLATE_FILE).is_file():
        try:
            return (src_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{src_dir / CHAT_TEMPLATE_FILE} is not a readable text file: {exc}") from None
    return None  # none, or transformers' list of named templates (kept as it is in the config)


def write_tokenizer_files(
    source: str | Path, dst: Path, model_max_length: int | None = None, chat_template: str | None = None
) -> dict[str, int]:
    """Write the tokenizer files of ``source`` (a tokenizer.json or a directory with one) into ``dst``.

    ``chat_template`` (Jinja text) replaces the source's template; the template is written into
    tokenizer_config.json and chat_template.jinja. Returns the special-token ids
    (``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``, those that exist) for config.json.
    """
    tok_file = Path(tokenizer_file(source))
    src_dir = tok_file.parent
    tokenizer = load_tokenizer(tok_file)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tok_file, dst / "tokenizer.json")

    config_file = src_dir / TOKENIZER_CONFIG
    config = _read_json(config_file) if config_file.is_file() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("clean_up_tokenization_spaces", False)
    if model_max_length and not config.get("model_max_length"):
        config["model_max_length"] = int(model_max_length)
    if not _token_name(config.get("eos_token")):
        config["eos_token"] = tokenizer.id_to_token(find_eod_id(tokenizer, tok_file))
    template = chat_template if chat_template is not None else _source_template(config, src_dir)
    if template is not None:
        # Both places transformers reads it from: tokenizer_config.json (4.x) and chat_template.jinja
        # (4.43+ and 5, which prefer the file); the same text in each.
        config["chat_template"] = template
        (dst / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    (dst / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    ids: dict[str, int] = {}
    special: dict[str, str] = {}
    for key in _SPECIAL:
        name = _token_name(config.get(key))
        if name is None:
            continue
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise DataError(
                f"{config_file if config_file.is_file() else tok_file}: {key} {name!r} is not in the "
                "vocabulary of tokenizer.json; fix tokenizer_config.json."
            )
        special[key] = name
        if key != "unk_token":
            ids[f"{key}_id"] = int(token_id)
    (dst / SPECIAL_TOKENS_MAP).write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")

    gen_file = src_dir / GENERATION_CONFIG
    generation = _read_json(gen_file) if gen_file.is_file() else {}
    for key, value in ids.items():
        generation.setdefault(key, value)
    (dst / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return ids
