"""The typed ``train_dataset.dataloader`` section of a ``TextDataLoader`` (an ``HFDataLoader`` is
translated into one first, hf_loader.py): every key checked at load, without reading a file.

What needs files or the model stays for later: the model's ``seq_length`` is compared by
:meth:`TextLoader.check_against_model`; the tokenizer, the token ids against the vocabulary and the
data files are read when the loader is built (text_settings.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, PrivateAttr, ValidationError, model_validator

from lmforge.errors import ConfigError, DataError

from .config import Blend, parse_blend, unknown_keys_message
from .schema_errors import config_error
from .text_format import BUILTIN_TEMPLATES

KEY = "train_dataset.dataloader"
TEXT_TYPE = "TextDataLoader"
# shuffle: documents are permuted within windows of this many (memory holds one window of raw rows).
DEFAULT_SHUFFLE_BUFFER = 10_000
COLUMNS = ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask", "actual_seq_len")
DEFAULT_COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _data_path(value: Any) -> Blend:
    return parse_blend(value, f"{KEY}.data_path")


def _tokenizer(value: Any) -> str:
    # MindSpore Transformers writes the tokenizer as a mapping; lmforge reads one local file from it.
    if isinstance(value, dict):
        value = value.get("tokenizer_file") or value.get("path") or value.get("vocab_file")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{KEY}.tokenizer is required: a local tokenizer.json or a directory holding one.")
    return value


def _seq_length(value: Any) -> int | None:
    if value is not None and (not _is_int(value) or value < 1):
        raise ConfigError(
            f"{KEY}.seq_length must be a positive integer (the model's seq_length); got {value!r}."
        )
    return value


def _columns(value: Any) -> list[str]:
    columns = value or list(DEFAULT_COLUMNS)  # an empty list or null: the default columns
    if (
        not isinstance(columns, list)
        or not all(c in COLUMNS for c in columns)
        or len(set(columns)) != len(columns)
    ):
        raise ConfigError(
            f"{KEY}.column_names must list distinct columns among {', '.join(COLUMNS)}; got {columns!r}."
        )
    return list(columns)


def _text_key(name: str) -> Any:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{KEY}.{name} must be a non-empty string; got {value!r}.")
        return value

    return BeforeValidator(check)


def _chat_template(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{KEY}.chat_template must be a Jinja template string or 'chatml'; got {value!r}.")
    template = BUILTIN_TEMPLATES.get(value, value) if value else None
    if template:
        _probe_template(template)
    return value or None


def _probe_template(template: str) -> None:
    """Compile and render a two-turn conversation now, so that a template the sandbox refuses is found
    at load (``lmforge check``), not by the loader's workers after the model is built."""
    from .text_format import SANDBOX_REFUSAL, compile_template, render_template

    try:
        compiled = compile_template(template)
    except Exception as exc:  # jinja2's TemplateSyntaxError
        raise ConfigError(f"{KEY}.chat_template is not a valid Jinja template: {exc}") from None
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        render_template(compiled, messages=probe, add_generation_prompt=False, bos_token="", eos_token="")
    except DataError as exc:
        if SANDBOX_REFUSAL in str(exc):
            raise ConfigError(f"{KEY}.chat_template: {exc}") from None
        # other template errors depend on the conversation: they are reported with the row that fails


def _pack(value: Any) -> str:
    if value not in ("concat", "whole"):
        raise ConfigError(
            f"{KEY}.pack must be 'concat' (split documents across samples, for pre-training) or 'whole' "
            f"(never split a document, pad instead, for SFT); got {value!r}."
        )
    return value


def _token_id(name: str) -> Any:
    def check(value: Any) -> int | None:
        if value is not None and (not _is_int(value) or value < 0):
            raise ConfigError(f"{KEY}.{name} must be a token id (an integer >= 0); got {value!r}.")
        return value

    return BeforeValidator(check)


def flag_key(name: str) -> Any:
    """The validator of a true/false key of a loader section (the Megatron loader's too), named in its message."""

    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{KEY}.{name} must be true or false; got {value!r}.")
        return value

    return BeforeValidator(check)


def _eod_pad_length(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{KEY}.eod_pad_length must be a positive integer; got {value!r}.")
    return value


def _shuffle_buffer(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ConfigError(
            f"{KEY}.shuffle_buffer must be a positive number of documents (each window of that many "
            f"consecutive documents is shuffled; default {DEFAULT_SHUFFLE_BUFFER}); got {value!r}."
        )
    return value


def _valid_data_path(value: Any) -> list[str] | None:
    if value is None:
        return None
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(
            f"{KEY}.valid_data_path must be a list of files / globs / save_to_disk directories (the validation "
            f"set, read in full at every evaluation); got {value!r}."
        )
    return list(paths)


def _validation_split(value: Any) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1
    ):
        raise ConfigError(
            f"{KEY}.validation_split must be a fraction between 0 and 1 (e.g. 0.05: one document in 20 of "
            f"data_path is held out of training for validation); got {value!r}."
        )
    return None if value is None else float(value)


class TextLoader(BaseModel):
    """A validated TextDataLoader section (an HFDataLoader translated into one). The tokenizer and the
    files are read when the loader is built; the model's seq_length is compared by check_against_model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["TextDataLoader"] = "TextDataLoader"
    data_path: Annotated[Blend, BeforeValidator(_data_path)]
    tokenizer: Annotated[str, BeforeValidator(_tokenizer)]
    seq_length: Annotated[int | None, BeforeValidator(_seq_length)] = None
    column_names: Annotated[list[str], BeforeValidator(_columns)] = list(DEFAULT_COLUMNS)
    text_key: Annotated[str, _text_key("text_key")] = "text"
    messages_key: Annotated[str, _text_key("messages_key")] = "messages"
    prompt_key: Annotated[str, _text_key("prompt_key")] = "prompt"
    response_key: Annotated[str, _text_key("response_key")] = "response"
    chat_template: Annotated[str | None, BeforeValidator(_chat_template)] = None  # as written ('chatml')
    pack: Annotated[Literal["concat", "whole"], BeforeValidator(_pack)] = "concat"
    eod: Annotated[int | None, _token_id("eod")] = None  # None: the tokenizer's end-of-document token
    pad: Annotated[int | None, _token_id("pad")] = None  # None: eod
    eod_mask_loss: Annotated[bool, flag_key("eod_mask_loss")] = False
    eod_pad_length: Annotated[int, BeforeValidator(_eod_pad_length)] = 128
    shuffle: Annotated[bool, flag_key("shuffle")] = False
    shuffle_buffer: Annotated[int, BeforeValidator(_shuffle_buffer)] = DEFAULT_SHUFFLE_BUFFER
    valid_data_path: Annotated[list[str] | None, BeforeValidator(_valid_data_path)] = None
    validation_split: Annotated[float | None, BeforeValidator(_validation_split)] = None
    # Declared by the typed section; the tokenization workers are always processes here.
    python_multiprocessing: Annotated[bool, flag_key("python_multiprocessing")] = False
    # The key the file named the sources under: data_path, or an HFDataLoader's data_files / path.
    _sources_key: str = PrivateAttr(default="data_path")

    @model_validator(mode="before")
    @classmethod
    def _known_and_required(cls, loader: Any) -> Any:
        valid = sorted(cls.model_fields)
        unknown = sorted(set(loader) - set(valid))
        if unknown:
            raise ConfigError(unknown_keys_message(KEY, unknown, valid, TEXT_TYPE))
        if loader.get("data_path") is None:
            raise ConfigError(
                f"{KEY}.data_path is required: a list of files / globs / save_to_disk directories, or "
                "weight/path pairs ['0.7', 'a.jsonl.gz', '0.3', 'b.parquet']."
            )
        if loader.get("tokenizer") is None:
            _tokenizer(None)  # the required-key message
        return loader

    @model_validator(mode="after")
    def _one_validation_set(self) -> TextLoader:
        if self.valid_data_path is not None and self.validation_split is not None:
            raise ConfigError(
                f"{KEY}.valid_data_path and {KEY}.validation_split are both set; give the validation set its "
                "own files (valid_data_path) or hold a share of data_path out for it (validation_split), not both."
            )
        return self

    @property
    def sources_key(self) -> str:
        """The dotted key the training sources were written under (for messages about them)."""
        return f"{KEY}.{self._sources_key}"

    @property
    def template(self) -> str | None:
        """The chat template's Jinja source (a built-in name such as 'chatml' resolved)."""
        return BUILTIN_TEMPLATES.get(self.chat_template, self.chat_template) if self.chat_template else None

    def sequence_length(self, seq_length: int | None) -> int:
        """The loader's sequence length: its own ``seq_length`` or else the model's, which must agree."""
        seq = self.seq_length if self.seq_length is not None else seq_length
        if seq is None:
            raise ConfigError(
                f"{KEY}.seq_length must be a positive integer (the model's seq_length); got None."
            )
        if seq_length is not None and seq != seq_length:
            raise ConfigError(f"{KEY}.seq_length ({seq}) must equal model.seq_length ({seq_length}).")
        return seq

    def check_against_model(self, seq_length: int | None, vocab_size: int | None) -> None:
        self.sequence_length(seq_length)

    def tokenizer_candidates(self) -> list[str]:
        """Where the run's tokenizer.json may be: the tokenizer this section names."""
        return [self.tokenizer]


def text_loader_schema(loader: dict[str, Any], sources_key: str = "data_path") -> TextLoader:
    """Type a TextDataLoader mapping (``sources_key``: the key its data_path was written under); one
    ConfigError names every problem by its dotted key."""
    try:
        typed = TextLoader.model_validate(loader)
        typed._sources_key = sources_key
        return typed
    except ValidationError as exc:
        raise config_error(exc, KEY) from None
