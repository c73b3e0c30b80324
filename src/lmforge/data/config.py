"""The ``train_dataset.dataloader.config`` keys of the Megatron loader, validated with dotted paths."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError

from .indices import parse_split, split_matrix

CONFIG_PATH = "train_dataset.dataloader.config"


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes with optional (normalised) weights."""

    prefixes: list[str]
    weights: list[float] | None


@dataclass(frozen=True)
class GPTDatasetConfig:
    seq_length: int
    seed: int = 1234
    data_path: Blend | None = None
    train_data_path: Blend | None = None
    valid_data_path: Blend | None = None
    test_data_path: Blend | None = None
    split: str | None = None
    split_weights: list[float] | None = None
    path_to_cache: str | None = None
    mmap_bin_files: bool | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    create_compressed_eod_mask: bool = False
    eod_pad_length: int = 128
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    eod: int = -1
    pad: int = -1
    num_dataset_builder_threads: int = 1
    mid_level_dataset_surplus: float = 0.005
    extra_keys: dict[str, Any] = field(default_factory=dict)

    @property
    def extra_token(self) -> int:
        return 1 if self.add_extra_token_to_sequence else 0

    def blend_for(self, split_index: int) -> tuple[Blend | None, tuple[float, float] | None]:
        """The blend and split book-ends that feed split 0/1/2 (train/valid/test)."""
        if self.data_path is not None:
            return self.data_path, split_matrix(self.split_weights or [1.0, 0.0, 0.0])[split_index]
        per_split = (self.train_data_path, self.valid_data_path, self.test_data_path)[split_index]
        return per_split, ((0.0, 1.0) if per_split is not None else None)


_BOOL_KEYS = (
    "reset_position_ids",
    "reset_attention_mask",
    "eod_mask_loss",
    "create_attention_mask",
    "create_compressed_eod_mask",
    "drop_last_partial_validation_sequence",
    "add_extra_token_to_sequence",
)


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


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key} must be true or false; got {value!r}.")


def _as_int(value: Any, key: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer; got {value!r}.")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}; got {value}.")
    return value


def parse_gpt_config(raw: Any, *, vocab_size: int | None = None, path: str = CONFIG_PATH) -> GPTDatasetConfig:
    """Validate the ``config`` mapping of a BlendedMegatronDatasetDataLoader."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} must be a mapping of GPTDataset settings (seq_length, data_path, split, ...)."
        )
    known = {f.name for f in dataclasses.fields(GPTDatasetConfig)} - {"split_weights", "extra_keys"}
    known |= {"compressed_eod_mask_length", "s3_cache_path"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(unknown_keys_message(path, unknown, sorted(known), "GPTDataset"))
    if raw.get("s3_cache_path"):
        raise ConfigError(
            f"{path}.s3_cache_path is not supported: lmforge reads and caches local files only."
        )
    values: dict[str, Any] = {}
    if raw.get("seq_length") is None:
        raise ConfigError(
            f"{path}.seq_length is required: sequence_length cannot be None when init megatron dataset. "
            "Set it to the model's seq_length."
        )
    values["seq_length"] = _as_int(raw["seq_length"], f"{path}.seq_length", 1)
    if "seed" in raw:
        values["seed"] = _as_int(raw["seed"], f"{path}.seed", 0)
    for key in _BOOL_KEYS:
        if raw.get(key) is not None:
            values[key] = _as_bool(raw[key], f"{path}.{key}")
    for key in ("eod", "pad"):
        if raw.get(key) is not None:
            values[key] = _as_int(raw[key], f"{path}.{key}", -1)
    pad_length = raw.get("eod_pad_length", raw.get("compressed_eod_mask_length"))
    if pad_length is not None:
        values["eod_pad_length"] = _as_int(pad_length, f"{path}.eod_pad_length", 1)
    if raw.get("num_dataset_builder_threads") is not None:
        values["num_dataset_builder_threads"] = _as_int(
            raw["num_dataset_builder_threads"], f"{path}.num_dataset_builder_threads", 1
        )
    if raw.get("mmap_bin_files") is not None:
        values["mmap_bin_files"] = _as_bool(raw["mmap_bin_files"], f"{path}.mmap_bin_files")
    if raw.get("mid_level_dataset_surplus") is not None:
        surplus = raw["mid_level_dataset_surplus"]
        if isinstance(surplus, bool) or not isinstance(surplus, (int, float)) or surplus < 0:
            raise ConfigError(f"{path}.mid_level_dataset_surplus must be a number >= 0; got {surplus!r}.")
        values["mid_level_dataset_surplus"] = float(surplus)
    if raw.get("path_to_cache") is not None:
        values["path_to_cache"] = str(raw["path_to_cache"])

    for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if raw.get(key) is not None:
            values[key] = parse_blend(raw[key], f"{path}.{key}")
    per_split = [k for k in ("train_data_path", "valid_data_path", "test_data_path") if k in values]
    if "data_path" in values and per_split:
        raise ConfigError(
            f"{path}.data_path and {path}.{per_split[0]} are mutually exclusive: give one blend split by "
            f"{path}.split, or one blend per split."
        )
    if "data_path" not in values and not per_split:
        raise ConfigError(
            f"{path} names no data: set {path}.data_path (with {path}.split) or "
            f"{path}.train_data_path / valid_data_path / test_data_path to Megatron dataset prefixes. "
            "(Megatron's mock data is not supported.)"
        )
    if "data_path" in values:
        split = raw.get("split")
        if split is None:
            raise ConfigError(
                f'{path}.split is required with {path}.data_path: a string like "98,2,0" giving the '
                "train/valid/test shares of the documents."
            )
        try:
            values["split_weights"] = parse_split(str(split))
        except ValueError:
            raise ConfigError(
                f"{path}.split must hold up to three non-negative numbers with a positive sum, like "
                f'"98,2,0"; got {split!r}.'
            ) from None
        values["split"] = str(split)
    elif raw.get("split") is not None:
        values["split"] = str(raw["split"])  # ignored with per-split paths, as in Megatron

    cfg = GPTDatasetConfig(**values)
    eod_flags = [
        k for k in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask") if getattr(cfg, k)
    ]
    if cfg.create_compressed_eod_mask:
        eod_flags.append("create_compressed_eod_mask")
    if eod_flags and cfg.eod < 0:
        raise ConfigError(
            f"{path}.{eod_flags[0]} needs the end-of-document token: set {path}.eod to its id "
            "(the id the preprocessing appended, e.g. 0 for the demo tokenizer)."
        )
    if vocab_size is not None:
        check_token_ids(cfg, vocab_size, path)
    return cfg


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


def no_effect_keys(raw: dict[str, Any]) -> list[str]:
    """Keys that were set explicitly but change nothing in lmforge (warned about at build time)."""
    out = []
    if raw.get("num_dataset_builder_threads") not in (None, 1):
        out.append("num_dataset_builder_threads")
    if raw.get("mmap_bin_files") is False:
        out.append("mmap_bin_files")
    return out
