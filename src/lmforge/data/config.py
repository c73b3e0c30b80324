"""The ``train_dataset.dataloader.config`` keys of the Megatron loader: a pydantic schema whose
messages name each key by its dotted path."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, model_validator

from lmforge.errors import ConfigError

from .indices import parse_split, split_matrix
from .schema_errors import config_error

CONFIG_PATH = "train_dataset.dataloader.config"


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes with optional (normalised) weights."""

    prefixes: list[str]
    weights: list[float] | None


def parse_blend(value: Any, key: str) -> Blend:
    """A Megatron ``--data-path`` list: prefixes, or flat (weight, prefix) pairs."""
    if isinstance(value, str):
        value = value.split()
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, (str, int, float)) for v in value)
    ):
        raise ConfigError(
            f"{key} must be a non-empty list of dataset prefixes (['data/a_text_document', ...]) or of "
            f"weight/prefix pairs (['0.3', 'data/a', '0.7', 'data/b']); got {value!r}."
        )
    items = [str(v).strip() for v in value]
    weights: list[float] | None = None
    prefixes = items
    if len(items) % 2 == 0:
        # Megatron: an even-length list whose every other entry parses as a float is (weight, prefix)
        # pairs; if any weight fails to parse, the whole list is prefixes.
        try:
            weights = [float(w) for w in items[0::2]]
            prefixes = items[1::2]
        except ValueError:
            weights, prefixes = None, items
    if weights is not None:
        if any(not (0 < w < math.inf) for w in weights):  # also nan and inf
            raise ConfigError(f"{key}: every blend weight must be > 0 and finite; got {weights}.")
        total = sum(weights)
        weights = [w / total for w in weights]
    return Blend(prefixes=prefixes, weights=weights)


def _int_at(minimum: int, maximum: tuple[int, str] | None = None) -> Callable[[Any, ValidationInfo], int]:
    def check(value: Any, info: ValidationInfo) -> int:
        key = f"{CONFIG_PATH}.{info.field_name}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer; got {value!r}.")
        if value < minimum:
            raise ConfigError(f"{key} must be >= {minimum}; got {value}.")
        if maximum is not None and value > maximum[0]:
            raise ConfigError(f"{key} must be <= {maximum[1]}; got {value}.")
        return value

    return check


def _bool(value: Any, info: ValidationInfo) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{CONFIG_PATH}.{info.field_name} must be true or false; got {value!r}.")


def _surplus(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{CONFIG_PATH}.mid_level_dataset_surplus must be a number >= 0; got {value!r}.")
    return float(value)


def _blend(value: Any, info: ValidationInfo) -> Blend:
    return parse_blend(value, f"{CONFIG_PATH}.{info.field_name}")


def _text(value: Any) -> str:
    return str(value)  # a split written as a number (split: 1) or a path is its text


def Int(minimum: int, maximum: tuple[int, str] | None = None) -> Any:  # noqa: N802 (a type, named like one)
    """An integer >= ``minimum`` and, given ``(value, why)``, <= value (a bool is refused)."""
    return Annotated[int, BeforeValidator(_int_at(minimum, maximum))]


Bool = Annotated[bool, BeforeValidator(_bool)]
BlendPaths = Annotated[Blend, BeforeValidator(_blend)]
Text = Annotated[str, BeforeValidator(_text)]

# Keys the original takes that lmforge reads under another name or refuses when set.
_INPUT_ONLY_KEYS = ("compressed_eod_mask_length", "s3_cache_path")


class GPTDatasetConfig(BaseModel):
    """The typed ``train_dataset.dataloader.config`` of a BlendedMegatronDatasetDataLoader: Megatron's
    GPTDatasetConfig keys, validated with their dotted paths. A key written as null keeps its default
    (``seed`` excepted, as before: null is not a seed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_length: Int(1)
    # The sample order's numpy RandomState (as Megatron's) takes seeds up to 2**32 - 1 only.
    seed: Int(
        0, (2**32 - 1, "4294967295 (2**32 - 1, the range of numpy's RandomState that orders the samples)")
    ) = 1234
    data_path: BlendPaths | None = None
    train_data_path: BlendPaths | None = None
    valid_data_path: BlendPaths | None = None
    test_data_path: BlendPaths | None = None
    split: Text | None = None
    path_to_cache: Text | None = None
    mmap_bin_files: Bool | None = None
    reset_position_ids: Bool = False
    reset_attention_mask: Bool = False
    eod_mask_loss: Bool = False
    create_attention_mask: Bool = True
    create_compressed_eod_mask: Bool = False
    # compressed_eod_mask_length (the original's other name) is read into it.
    eod_pad_length: Int(1) = 128
    drop_last_partial_validation_sequence: Bool = True
    add_extra_token_to_sequence: Bool = True
    eod: Int(-1) = -1
    pad: Int(-1) = -1
    num_dataset_builder_threads: Int(1) = 1
    mid_level_dataset_surplus: Annotated[float, BeforeValidator(_surplus)] = 0.005

    @model_validator(mode="before")
    @classmethod
    def _written(cls, raw: Any) -> Any:
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{CONFIG_PATH} must be a mapping of GPTDataset settings (seq_length, data_path, split, ...)."
            )
        unknown = sorted(set(raw) - set(cls.model_fields) - set(_INPUT_ONLY_KEYS))
        if unknown:
            valid = sorted({*cls.model_fields, *_INPUT_ONLY_KEYS})
            raise ConfigError(unknown_keys_message(CONFIG_PATH, unknown, valid, "GPTDataset"))
        if raw.get("s3_cache_path"):
            raise ConfigError(
                f"{CONFIG_PATH}.s3_cache_path is not supported: lmforge reads and caches local files only."
            )
        if raw.get("seq_length") is None:
            raise ConfigError(
                f"{CONFIG_PATH}.seq_length is required: sequence_length cannot be None when init megatron "
                "dataset. Set it to the model's seq_length."
            )
        values = {
            k: v for k, v in raw.items() if k not in _INPUT_ONLY_KEYS and (v is not None or k == "seed")
        }
        if values.get("eod_pad_length") is None and raw.get("compressed_eod_mask_length") is not None:
            values["eod_pad_length"] = raw["compressed_eod_mask_length"]
        return values

    @model_validator(mode="after")
    def _names_its_data(self) -> GPTDatasetConfig:
        per_split = [k for k in ("train_data_path", "valid_data_path", "test_data_path") if getattr(self, k)]
        if self.data_path is not None and per_split:
            raise ConfigError(
                f"{CONFIG_PATH}.data_path and {CONFIG_PATH}.{per_split[0]} are mutually exclusive: give one blend "
                f"split by {CONFIG_PATH}.split, or one blend per split."
            )
        if self.data_path is None and not per_split:
            raise ConfigError(
                f"{CONFIG_PATH} names no data: set {CONFIG_PATH}.data_path (with {CONFIG_PATH}.split) or "
                f"{CONFIG_PATH}.train_data_path / valid_data_path / test_data_path to Megatron dataset "
                "prefixes. (Megatron's mock data is not supported.)"
            )
        if self.data_path is not None:
            if self.split is None:
                raise ConfigError(
                    f'{CONFIG_PATH}.split is required with {CONFIG_PATH}.data_path: a string like "98,2,0" giving '
                    "the train/valid/test shares of the documents."
                )
            self.split_weights  # noqa: B018 (refuses a split without a positive share, naming the key)
        eod_flags = [
            k for k in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask") if getattr(self, k)
        ]
        if self.create_compressed_eod_mask:
            eod_flags.append("create_compressed_eod_mask")
        if eod_flags and self.eod < 0:
            raise ConfigError(
                f"{CONFIG_PATH}.{eod_flags[0]} needs the end-of-document token: set {CONFIG_PATH}.eod to its id "
                "(the id the preprocessing appended, e.g. 0 for the demo tokenizer)."
            )
        return self

    @property
    def split_weights(self) -> list[float] | None:
        """The normalised train/valid/test shares of ``split`` with ``data_path`` (None with per-split
        paths, where Megatron ignores ``split``)."""
        if self.data_path is None or self.split is None:
            return None
        try:
            return parse_split(self.split)
        except ValueError:
            raise ConfigError(
                f"{CONFIG_PATH}.split must hold up to three non-negative numbers with a positive sum, like "
                f'"98,2,0"; got {self.split!r}.'
            ) from None

    @property
    def extra_token(self) -> int:
        return 1 if self.add_extra_token_to_sequence else 0

    def blend_for(self, split_index: int) -> tuple[Blend | None, tuple[float, float] | None]:
        """The blend and split book-ends that feed split 0/1/2 (train/valid/test)."""
        if self.data_path is not None:
            return self.data_path, split_matrix(self.split_weights or [1.0, 0.0, 0.0])[split_index]
        per_split = (self.train_data_path, self.valid_data_path, self.test_data_path)[split_index]
        return per_split, ((0.0, 1.0) if per_split is not None else None)

    def no_effect_keys(self) -> list[str]:
        """Keys set to something that changes nothing in lmforge (warned about at load)."""
        out = []
        if self.num_dataset_builder_threads != 1:
            out.append("num_dataset_builder_threads")
        if self.mmap_bin_files is False:
            out.append("mmap_bin_files")
        return out


def gpt_config(raw: Any) -> GPTDatasetConfig:
    """The typed ``config`` of a BlendedMegatronDatasetDataLoader (the loader schema's part); one
    ConfigError names every problem by its dotted key."""
    try:
        return GPTDatasetConfig.model_validate(raw)
    except ValidationError as exc:
        raise config_error(exc, CONFIG_PATH) from None


def check_token_ids(cfg: GPTDatasetConfig, vocab_size: int, path: str = CONFIG_PATH) -> None:
    """``eod`` and ``pad`` are token ids of a model with ``vocab_size`` tokens (or -1, unset)."""
    for key in ("eod", "pad"):
        if getattr(cfg, key) >= vocab_size:
            raise ConfigError(
                f"{path}.{key} = {getattr(cfg, key)} is not a token id of the model "
                f"(model.vocab_size = {vocab_size}); valid: -1 (unset) or 0 .. {vocab_size - 1}."
            )


def unknown_keys_message(path: str, unknown: list[str], valid: list[str], owner: str) -> str:
    """One message naming every unknown key of ``path`` at once, each with its closest valid key."""
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        if close:
            hints.append(f"{close[0]} for {key}")
    named = ", ".join(f"{path}.{key}" for key in unknown)
    verb = f"is not a {owner} setting" if len(unknown) == 1 else f"are not {owner} settings"
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"{named} {verb}{hint}. Valid keys: {', '.join(valid)}."
