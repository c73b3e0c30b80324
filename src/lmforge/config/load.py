"""``load_config``: YAML or mapping + ``--set`` overrides -> a validated, frozen ``TrainConfig``.

Every failure is one :class:`~lmforge.errors.ConfigError` whose text names each offending key by its
full dotted path (``training.global_batch_size``, ``callbacks[0].type``) and says what is valid.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from lmforge.config.inert import collect_warnings
from lmforge.config.schema import TrainConfig
from lmforge.config.yaml_io import dump_yaml_text, parse_yaml_text, read_yaml_file
from lmforge.errors import ConfigError
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.config")

# Hints for keys the original treats as required (their class default None fails its type check).
_REQUIRED_HINTS = {
    "model": "the model section is required: model_type and architectures (e.g. qwen3 / Qwen3ForCausalLM) "
    "plus the structure of the model",
    "model.model_type": "model.model_type is required (e.g. qwen3, deepseek_v3)",
    "train_dataset": "the train_dataset section is required (at least train_dataset.dataloader.type)",
    "train_dataset.dataloader": "train_dataset.dataloader is required (at least its type)",
    "train_dataset.dataloader.type": "train_dataset.dataloader.type is required "
    "(e.g. BlendedMegatronDatasetDataLoader)",
    "lr_scheduler": "the lr_scheduler section is required (at least lr_scheduler.type)",
    "lr_scheduler.type": "lr_scheduler.type is required (e.g. ConstantWarmUpLR, CosineWithWarmUpLR)",
}


# --------------------------------------------------------------------------------------------------
# public API


def load_config(
    path_or_dict: str | Path | Mapping[str, Any], overrides: Sequence[str] | Mapping[str, Any] | None = None
) -> TrainConfig:
    """Load, override and validate a configuration.

    ``path_or_dict`` is a YAML file path or an already-parsed mapping (deep-copied, never modified).
    ``overrides`` are ``"dotted.key=yaml value"`` strings (as given to ``--set``) or a mapping of
    dotted keys to values; they are applied in order and validated like the file.
    """
    from lmforge.config.outputs import follow_output_dir_override

    file_raw, source = read_raw(path_or_dict)
    raw = apply_overrides(file_raw, overrides)
    return follow_output_dir_override(validate_config(raw, source), file_raw, overrides or [])


def read_raw(path_or_dict: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The plain top-level mapping of a file or mapping, and a name for it in messages."""
    if isinstance(path_or_dict, Mapping):
        return copy.deepcopy(dict(path_or_dict)), "the configuration mapping"
    if not isinstance(path_or_dict, (str, Path)):
        raise ConfigError(
            f"load_config expects a YAML file path or a mapping, got {type(path_or_dict).__name__}"
        )
    data = read_yaml_file(path_or_dict)
    source = str(path_or_dict)
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise ConfigError(
            f"Expected a mapping of sections (checkpoint:, training:, model:, ...) at the top level of "
            f"{source}, got {got} (Expected dict for TrainConfig, got {type(data)})."
        )
    return data, source


def validate_config(
    raw: Mapping[str, Any], source: str = "the configuration mapping", log_warnings: bool = True
) -> TrainConfig:
    """Validate a plain mapping into a ``TrainConfig``.

    Warnings (inert fields, overridden settings) are kept in ``cfg.warnings`` and, unless
    ``log_warnings`` is False, logged on the ``lmforge.config`` logger.
    """
    non_str = [k for k in raw if not isinstance(k, str)]
    if non_str:
        raise ConfigError(f"Top-level keys of {source} must be strings, got {non_str!r}.")
    schema_notes: list[str] = []
    try:
        with collected_log_warnings(schema_notes):
            cfg = TrainConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    warnings = collect_warnings(raw, cfg) + list(dict.fromkeys(schema_notes))
    cfg._warnings = tuple(warnings)
    if log_warnings:
        for line in warnings:
            _log.warning(line)
    return cfg


def validate_section(path: str, data: Mapping[str, Any]) -> Any:
    """One section (``train_dataset``, ``monitor.tensorboard``, ``callbacks``: an item) validated on its
    own, as ``load_config`` validates it. One ConfigError names every problem by its dotted key."""
    loc = tuple(path.split("."))
    cls = _class_at(loc)
    if cls is None:
        raise ValueError(f"{path!r} is not a section of TrainConfig")
    try:
        return cls.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, f"the {path} section", prefix=loc)) from None


@contextlib.contextmanager
def collected_log_warnings(notes: list[str]) -> Iterator[None]:
    """The warnings the building blocks log under ``lmforge`` (keys that change nothing, a warm-up
    longer than training) go to ``notes`` instead of log lines of their own (load_config, run plan)."""

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    root = logging.getLogger("lmforge")
    saved = (root.handlers[:], root.propagate, root.level)
    root.handlers = [_Collect(level=logging.WARNING)]
    root.propagate = False
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.handlers, root.propagate = saved[0], saved[1]
        root.setLevel(saved[2])


def config_warnings(cfg: TrainConfig) -> tuple[str, ...]:
    """Warnings found while loading ``cfg`` (fields that are accepted but have no effect, ...)."""
    return cfg.warnings


def dump_yaml(cfg: TrainConfig, path: str | Path | None = None) -> str:
    """The configuration as YAML text (defaults filled in); written to ``path`` when given."""
    text = dump_yaml_text(cfg.to_dict())
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


# --------------------------------------------------------------------------------------------------
# overrides


def split_key(key: str, where: str) -> list[str | int]:
    """``callbacks[0].type`` / ``callbacks.0.type`` -> ``["callbacks", 0, "type"]``."""
    parts: list[str | int] = []
    for piece in key.replace("[", ".[").split("."):
        if not piece:
            continue
        if piece.startswith("[") and piece.endswith("]") and piece[1:-1].isdigit():
            parts.append(int(piece[1:-1]))
        elif piece.isdigit() and parts:
            parts.append(int(piece))
        elif "[" in piece or "]" in piece:
            raise ConfigError(f"{where}: cannot read the key {key!r}; write it as section.key or list[0].key")
        else:
            parts.append(piece)
    if not parts or isinstance(parts[0], int):
        raise ConfigError(f"{where}: empty or invalid key {key!r}; expected e.g. training.steps=20")
    return parts


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(
            f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set training.steps=20 or "
            "--set optimizer.betas=[0.9,0.99]"
        )
    key, text = item.split("=", 1)
    value = parse_yaml_text(text, f"the value of --set {key.strip()}") if text.strip() else None
    return key.strip(), value


def apply_overrides(
    raw: dict[str, Any], overrides: Sequence[str] | Mapping[str, Any] | None
) -> dict[str, Any]:
    """A copy of ``raw`` with each override set; values of strings are parsed as YAML."""
    if not overrides:
        return raw
    if isinstance(overrides, str):
        overrides = [overrides]
    pairs = (
        list(overrides.items()) if isinstance(overrides, Mapping) else [_parse_override(o) for o in overrides]
    )
    result = copy.deepcopy(raw)
    for key, value in pairs:
        where = f"--set {key}"
        if key.startswith(".") or key.endswith(".") or ".." in key:
            # "training..steps" used to set training.steps silently (and check labelled it [file]).
            raise ConfigError(
                f"{where}: the key {key!r} has an empty part; write it as section.key, e.g. training.steps"
            )
        parts = split_key(key, where)
        node: Any = result
        for i, part in enumerate(parts[:-1]):
            here = _dotted(parts[: i + 1])
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    raise ConfigError(f"{where}: {here} does not exist (the list has fewer items)")
                node = node[part]
                continue
            if not isinstance(node, dict):
                raise ConfigError(
                    f"{where}: {_dotted(parts[:i])} is not a mapping, so it has no key {part!r}"
                )
            child = node.get(part)
            if child is None:
                child = [] if isinstance(parts[i + 1], int) else {}
                node[part] = child
            node = child
        last = parts[-1]
        if isinstance(last, int):
            if not isinstance(node, list) or last > len(node):
                raise ConfigError(f"{where}: {_dotted(parts)} is not an item of an existing list")
            if last == len(node):
                node.append(value)
            else:
                node[last] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"{where}: {_dotted(parts[:-1])} is not a mapping, so it has no key {last!r}")
    return result


# --------------------------------------------------------------------------------------------------
# error text


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class inside ``X``, ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _class_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    cls: type[BaseModel] | None = TrainConfig
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return None
        cls = _model_in(field.annotation)
    return cls


_TAGS = ("str", "int", "float", "bool", "none", "list", "dict")


def _clean_loc(loc: Sequence[Any]) -> list[str | int]:
    # Pydantic adds union-member and validator tags ("list[str]", "function-after[...]") to locations.
    cleaned: list[str | int] = []
    cls: type[BaseModel] | None = TrainConfig
    for part in loc:
        if isinstance(part, int):
            cleaned.append(part)
        elif cls is not None and part in cls.model_fields:
            cleaned.append(part)
            cls = _model_in(cls.model_fields[part].annotation)
        elif "[" in part or part in _TAGS:
            continue
        else:
            cleaned.append(part)
            cls = None
    return cleaned


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} ({text})"


_TYPE_WORDS = {
    "float_type": "a number",
    "float_parsing": "a number",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


# Keys that earlier versions of the original used, and what replaced them.
_RENAMED = {
    "tensorboard_dir": "output_dir",
    "tensorboard_log_interval": "log_interval",
    "tensorboard_queue_size": "queue_size",
    "enable_profiler": "enable_profiling",
    "stop_step": "end_step",
    "full_recompute": "mode: full with full_recompute_layer",
    "select_recompute": "mode: select with select_module",
    "hsdp_shard_size": "data_parallel_shard",
}


def _suggest(key: str, valid: Sequence[str]) -> str:
    if key in _RENAMED:
        return f" (renamed: did you mean {_RENAMED[key]}?)"
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _format_errors(exc: ValidationError, source: str, prefix: tuple[str, ...] = ()) -> str:
    unknown: dict[tuple[str | int, ...], list[str]] = {}
    messages: list[str] = []
    wrong_type: dict[str, tuple[list[str], Any]] = {}
    for err in exc.errors():
        loc = _clean_loc((*prefix, *err["loc"]))
        path = _dotted(loc)
        kind = err["type"]
        value = err.get("input")
        if kind == "extra_forbidden":
            unknown.setdefault(tuple(loc[:-1]), []).append(str(loc[-1]))
            continue
        if kind == "value_error":
            text = str(err.get("ctx", {}).get("error", err["msg"]))
            if path and not text.startswith(path.split("[")[0].split(".")[0]):
                text = f"{path}: {text}"
            messages.append(text)
        elif kind == "missing":
            messages.append(_REQUIRED_HINTS.get(path, f"{path} is required"))
        elif value is None and kind in _TYPE_WORDS:
            cls = _class_at(loc[:-1])
            owner = cls.__name__ if cls is not None else "TrainConfig"
            messages.append(
                f"{path} is null (Field '{owner}.{loc[-1]}' cannot be None): remove the line to use the "
                f"default, or give {_TYPE_WORDS[kind]}"
            )
        elif kind in _TYPE_WORDS:
            # A union field fails once per member type at the same path: one message lists them all.
            if path not in wrong_type:
                wrong_type[path] = ([], value)
                messages.append(path)  # placeholder, filled in below
            wants = wrong_type[path][0]
            if _TYPE_WORDS[kind] not in wants:
                wants.append(_TYPE_WORDS[kind])
        else:
            messages.append(f"{path}: {err['msg']}, got {_describe(value)}")
    for path, (wants, value) in wrong_type.items():
        hint = ""
        if "a mapping" in wants:
            hint = " (a section of key: value lines)"
        if isinstance(value, bool) and {"a number", "an integer"} & set(wants):
            hint = " (a boolean is never accepted as a number)"
        messages[messages.index(path)] = f"{path} must be {' or '.join(wants)}{hint}, got {_describe(value)}"
    unknown_messages = []
    for parent, keys in unknown.items():
        cls = _class_at(parent)
        name = cls.__name__ if cls is not None else "this section"
        valid = list(cls.model_fields) if cls is not None else []
        details = ", ".join(f"{_dotted([*parent, key])}{_suggest(key, valid)}" for key in keys)
        unknown_messages.append(
            f"Unknown configuration keys for {name}: {keys!r} ({details}). Valid keys of "
            f"{_dotted(parent) or 'the top level'}: {', '.join(valid)}"
        )
    # The original reports unknown keys only after the section's own checks pass; both are shown here.
    all_messages = unknown_messages + messages
    if len(all_messages) == 1:
        return f"Invalid configuration in {source}: {all_messages[0]}"
    numbered = "; ".join(f"({i}) {m}" for i, m in enumerate(all_messages, 1))
    return f"Invalid configuration in {source}, {len(all_messages)} problems: {numbered}"
