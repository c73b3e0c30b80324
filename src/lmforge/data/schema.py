"""The typed ``train_dataset.dataloader`` section: one schema per loader type, registered with the config.

``load_config`` dispatches on ``train_dataset.dataloader.type`` to the schema registered here, which
checks every key of the section without reading a file and returns a :class:`MegatronLoader` or a
:class:`TextLoader` (``cfg.train_dataset.dataloader.typed``); an unsupported type falls to the
catch-all, which names the supported ones. What needs the model (its ``seq_length`` and
``vocab_size``) is :meth:`check_against_model`, which ``TrainConfig`` calls once the model is typed
too. ``build_dataloader`` builds from the typed result and validates nothing again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from lmforge.config.registry import register_section_schema
from lmforge.errors import ConfigError
from lmforge.utils.logging import get_logger

from .config import CONFIG_PATH, GPTDatasetConfig, check_token_ids, gpt_config
from .schema_errors import config_error
from .text_schema import TextLoader, flag_key, text_loader_schema

if TYPE_CHECKING:
    from lmforge.config.sections_components import DataloaderConfig

log = get_logger("lmforge.data")

SECTION = "train_dataset.dataloader"
MEGATRON_TYPE = "BlendedMegatronDatasetDataLoader"
SUPPORTED_TYPES = (MEGATRON_TYPE, "TextDataLoader", "HFDataLoader")
# Text / Hugging Face data tokenized on the fly (text_loader.py; HFDataLoader is mapped onto it).
TEXT_TYPES = ("TextDataLoader", "HFDataLoader")
# Loader types of MindSpore Transformers that lmforge does not implement (named in the error).
KNOWN_UNSUPPORTED_TYPES = ("MindDataset", "OrderedIndexDataLoader")


def refuse_type(kind: Any) -> None:
    """The catch-all schema: a loader type lmforge does not implement, with the supported ones."""
    what = "is missing" if kind is None else f"is '{kind}'"
    extra = (
        f" lmforge does not implement MindSpore Transformers' {kind}; read Megatron .bin/.idx data (convert "
        "with 'lmforge data preprocess') or text / Hugging Face datasets with TextDataLoader."
        if kind in KNOWN_UNSUPPORTED_TYPES
        else ""
    )
    raise ConfigError(
        f"{SECTION}.type {what}.{extra} Supported: {', '.join(SUPPORTED_TYPES)} "
        f"(Unsupported dataloader type: {kind})."
    )


def _sizes(value: Any) -> list[int | None]:
    key = f"{SECTION}.sizes"
    if not isinstance(value, (list, tuple)) or len(value) > 3:
        raise ConfigError(
            f"{key} must be a list [train, valid, test] of sample counts (or null); got {value!r}."
        )
    out: list[int | None] = []
    for i, v in enumerate(list(value) + [None] * (3 - len(value))):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"{key}[{i}] must be a sample count >= 0 or null; got {v!r}.")
        out.append(v)
    return out


def _datasets_type(value: Any) -> str:
    if value != "GPTDataset":
        raise ConfigError(f"{SECTION}.datasets_type is '{value}'; the only supported value is GPTDataset.")
    return value


def check_columns(columns: Any, cfg: GPTDatasetConfig) -> list[str]:
    """The batch columns a GPTDataset with ``cfg`` can produce, in the order the file names them."""
    key = f"{SECTION}.column_names"
    if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) for c in columns) or not columns:
        raise ConfigError(f"{key} must be a list of column names; got {columns!r}.")
    available = ["input_ids", "labels", "loss_mask", "position_ids"]
    if cfg.create_compressed_eod_mask:
        available.append("actual_seq_len")
    elif cfg.create_attention_mask:
        available.append("attention_mask")
    for c in columns:
        if c in available:
            continue
        if c == "attention_mask":
            why = (
                f"{CONFIG_PATH}.create_compressed_eod_mask is true (it replaces the mask by actual_seq_len)"
                if cfg.create_compressed_eod_mask
                else f"{CONFIG_PATH}.create_attention_mask is false"
            )
            raise ConfigError(f"{key} asks for attention_mask but {why}.")
        if c == "actual_seq_len":
            raise ConfigError(
                f"{key} asks for actual_seq_len, which needs {CONFIG_PATH}.create_compressed_eod_mask: true."
            )
        raise ConfigError(f"{key} contains '{c}'; this dataset provides: {', '.join(available)}.")
    if len(set(columns)) != len(columns):
        raise ConfigError(f"{key} names a column twice: {list(columns)}.")
    return list(columns)


class MegatronLoader(BaseModel):
    """A validated BlendedMegatronDatasetDataLoader section. Keys it does not read are warned about,
    all at once, and dropped (the original's allow_extra); a key written as null keeps its default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "yes" is not a bool

    type: Literal["BlendedMegatronDatasetDataLoader"]
    datasets_type: Annotated[str, BeforeValidator(_datasets_type)] = "GPTDataset"
    config: Annotated[GPTDatasetConfig, BeforeValidator(gpt_config)]
    sizes: Annotated[list[int | None], BeforeValidator(_sizes)] = [None, None, None]
    column_names: list[str] = ["input_ids", "labels"]
    shuffle: Annotated[bool, flag_key("shuffle")] = False
    python_multiprocessing: Annotated[bool, flag_key("python_multiprocessing")] = False
    tokenizer: Any = None  # the original's tokenizer settings: the .bin files are tokenized already

    @model_validator(mode="before")
    @classmethod
    def _read_keys(cls, loader: Any) -> Any:
        unknown = sorted(set(loader) - set(cls.model_fields))
        if unknown:
            log.warning(
                "%s not used by %s; ignored (valid keys: %s)",
                ", ".join(f"{SECTION}.{k}" for k in unknown) + (" is" if len(unknown) == 1 else " are"),
                MEGATRON_TYPE,
                ", ".join(sorted(cls.model_fields)),
            )
        values = {k: v for k, v in loader.items() if v is not None and k not in unknown}
        if "config" not in values:
            raise ConfigError(
                f"{CONFIG_PATH} is required for {MEGATRON_TYPE}: at least seq_length, "
                "data_path and split (or train_data_path / valid_data_path)."
            )
        return values

    @model_validator(mode="after")
    def _columns_and_no_effect_keys(self) -> MegatronLoader:
        check_columns(self.column_names, self.config)
        for key in self.config.no_effect_keys():
            log.warning("%s.%s has no effect in lmforge (see docs/data.md)", CONFIG_PATH, key)
        return self

    @property
    def columns(self) -> list[str]:
        return self.column_names

    def check_against_model(self, seq_length: int | None, vocab_size: int | None) -> None:
        if seq_length is not None and self.config.seq_length != seq_length:
            raise ConfigError(
                f"{CONFIG_PATH}.seq_length ({self.config.seq_length}) must equal model.seq_length ({seq_length})."
            )
        if vocab_size is not None:
            check_token_ids(self.config, vocab_size)

    def tokenizer_candidates(self) -> list[str]:
        """Where the run's tokenizer.json may be: a path the original's ``tokenizer`` settings name, else
        the directories of the training data (``lmforge data demo`` writes it next to the .bin files)."""
        found: list[str] = []
        if isinstance(self.tokenizer, str) and self.tokenizer:
            found.append(self.tokenizer)
        elif isinstance(self.tokenizer, dict):
            found += [
                self.tokenizer[k]
                for k in ("tokenizer_file", "path", "vocab_file")
                if isinstance(self.tokenizer.get(k), str)
            ]
        for blend in (self.config.train_data_path, self.config.data_path):
            found += [os.path.dirname(p) for p in (blend.prefixes if blend is not None else [])]
        return found


def megatron_loader(loader: Mapping[str, Any]) -> MegatronLoader:
    """Type a BlendedMegatronDatasetDataLoader section's written keys; one ConfigError names every problem."""
    try:
        return MegatronLoader.model_validate(loader)
    except ValidationError as exc:
        raise config_error(exc, SECTION) from None


def text_loader(loader: Mapping[str, Any]) -> TextLoader:
    """Type a TextDataLoader mapping, or an HFDataLoader translated into one, without reading a file."""
    mapping = dict(loader)
    if mapping.get("type") != "HFDataLoader":
        return text_loader_schema(mapping)
    from .hf_loader import translate_hf_loader

    # An HFDataLoader names its files with data_files (or path); they are its data_path here.
    return text_loader_schema(
        translate_hf_loader(mapping), "data_files" if mapping.get("data_files") else "path"
    )


TypedDataloader = MegatronLoader | TextLoader


def type_dataloader(node: DataloaderConfig) -> TypedDataloader:
    """The typed form of a validated dataloader config section; ConfigError when invalid."""
    loader = node.written_values()
    kind = loader.get("type")
    if kind == MEGATRON_TYPE:
        return megatron_loader(loader)
    if kind in TEXT_TYPES:
        return text_loader(loader)
    refuse_type(kind)
    raise AssertionError("unreachable")  # refuse_type raises


def _schema(node: DataloaderConfig, path: str, cfg: Mapping[str, Any]) -> TypedDataloader:
    return type_dataloader(node)


def register() -> None:
    """Register every loader type and the catch-all (idempotent)."""
    for name in (*SUPPORTED_TYPES, "*"):
        register_section_schema(SECTION, name, _schema)
