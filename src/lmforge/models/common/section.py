"""The typed ``model`` section of one family: a pydantic class made from the family's key table.

``section_class(keys)`` makes (once per family) a frozen, strict pydantic model with one field per key
the family accepts (``FamilyKeys.hf`` and the original's keys, ``config_keys.py``), its default the
table's and its type the default's (a bool key takes only a bool, an int key only an int, a float key
an int or a float, never a bool; a key whose default is None takes any value, its family checks it).
Validation folds the original's aliases (``num_layers`` → ``num_hidden_layers``) into the canonical
field, refuses unknown keys with the closest valid key, and refuses what lmforge always computes in
fp32. ``validate_family_section(raw, keys)`` turns pydantic's errors into one ``ConfigError`` naming
``model.<key>``; the family's ``to_transformer_config`` reads the result's attributes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
    model_validator,
)

from lmforge.errors import ConfigError
from lmforge.models.common.config_keys import (
    ALIASES,
    FP32_ONLY_KEYS,
    HF_BOOKKEEPING_KEYS,
    SOURCE_KEYS,
    FamilyKeys,
    alias_target,
    unknown_key_error,
)
from lmforge.models.common.dtypes import parse_dtype
from lmforge.utils.logging import get_logger

_log = get_logger("lmforge.models")
_YAML_FLOAT_NOTE = "Note: YAML reads 1e-6 without a dot as a string; write 1.e-6."


class FamilySection(BaseModel):
    """The validated ``model`` section of one family (subclassed per family by :func:`section_class`)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, protected_namespaces=())
    keys: ClassVar[FamilyKeys]

    model_type: StrictStr
    # The architecture name: the registry checks it against model_type and takes the first of a list.
    architectures: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _fold_keys(cls, data: Any) -> Any:
        keys = cls.keys
        valid = keys.valid_keys()
        unknown = [key for key in data if key not in valid]
        if unknown:
            raise unknown_key_error(unknown, valid, f"model_type '{keys.model_type}'")
        bookkeeping = [k for k in data if k in HF_BOOKKEEPING_KEYS]
        if bookkeeping:
            _log.warning(
                "model: %s accepted but have no effect in lmforge: Hugging Face config.json bookkeeping (the "
                "data's eod/pad come from train_dataset, the dtype from model.compute_dtype).",
                ", ".join(f"model.{k}" for k in bookkeeping),
            )
        # Bookkeeping and source keys describe where the section came from, not the model: they stay in
        # the section as given (TransformerConfig.section), not among the typed fields.
        values = {k: v for k, v in data.items() if k not in HF_BOOKKEEPING_KEYS and k not in SOURCE_KEYS}
        for alias in ALIASES:
            canonical = alias_target(alias, list(cls.model_fields))
            if alias not in data or canonical is None:
                continue
            if canonical in data and data[canonical] != data[alias]:
                raise ConfigError(
                    f"model.{alias} = {data[alias]!r} contradicts model.{canonical} = {data[canonical]!r}; "
                    f"they are the same setting, give one of them (or equal values)."
                )
            values[canonical] = data[alias]
        return values

    @model_validator(mode="after")
    def _check_numerics(self) -> FamilySection:
        for key in FP32_ONLY_KEYS:
            value = getattr(self, key, None)
            if value is not None and parse_dtype(value, f"model.{key}") != parse_dtype("float32", key):
                raise ConfigError(
                    f"model.{key} = {value!r} is not supported: lmforge always computes this in float32 "
                    "(the original's default). Use 'float32' or remove the key."
                )
        if parse_dtype(self.params_dtype, "model.params_dtype") != parse_dtype("float32", "params_dtype"):
            _log.warning(
                "model.params_dtype = %r has no effect: lmforge keeps float32 master weights for every "
                "low-precision parameter (parameters themselves are stored in compute_dtype).",
                self.params_dtype,
            )
        if self.use_flash_attention is False:
            _log.warning(
                "model.use_flash_attention: false has no effect: attention always runs through "
                "scaled_dot_product_attention, which picks its own kernel."
            )
        return self


def _annotation(default: Any) -> Any:
    # The default's type is the key's type; None is always accepted (the key's default then applies
    # through the family's conversion). bool before int: a bool is an int to Python.
    for python_type, strict in ((bool, StrictBool), (int, StrictInt), (float, StrictFloat), (str, StrictStr)):
        if isinstance(default, python_type):
            return strict | None
    return Any


_CLASSES: dict[int, tuple[FamilyKeys, type[FamilySection]]] = {}


def section_class(keys: FamilyKeys) -> type[FamilySection]:
    """The typed section class of the family whose key table is ``keys`` (made once per table)."""
    known = _CLASSES.get(id(keys))
    if known is not None and known[0] is keys:
        return known[1]
    defaults = {**keys.hf, **{k: d for k, (d, _) in keys.mf_keys().items()}}
    fields: dict[str, Any] = {name: (_annotation(d), d) for name, d in defaults.items()}
    name = "".join(part.title() for part in keys.model_type.split("_")) + "Section"
    cls = create_model(name, __base__=FamilySection, **fields)
    cls.keys = keys
    _CLASSES[id(keys)] = (keys, cls)
    return cls


def validate_family_section(raw: dict[str, Any], keys: FamilyKeys, architecture: str) -> FamilySection:
    """``raw`` (a model section; its ``architectures`` already resolved to ``architecture``) validated
    by the family's typed schema. Raises one ``ConfigError`` naming each offending ``model.<key>``."""
    cls = section_class(keys)
    try:
        return cls.model_validate({**raw, "architectures": architecture})
    except ValidationError as exc:
        raise _config_error(exc, raw, cls) from None


def _config_error(exc: ValidationError, raw: dict[str, Any], cls: type[FamilySection]) -> ConfigError:
    messages = []
    for err in exc.errors():
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, ConfigError):  # raised by a validator above with its own text
            return cause
        key = str(err["loc"][0]) if err["loc"] else ""
        # A value given under an alias is checked as its canonical key: name what the file wrote.
        written = next((a for a in ALIASES if a in raw and alias_target(a, [key]) == key), key)
        written = key if key in raw else written
        value = err.get("input")
        default = cls.model_fields[key].default if key in cls.model_fields else None
        if err["type"] in ("bool_type", "int_type", "float_type", "string_type"):
            messages.append(
                f"model.{written} = {value!r} has type {type(value).__name__}; expected "
                f"{type(default).__name__} (e.g. {default!r}). {_YAML_FLOAT_NOTE}"
            )
        else:
            messages.append(f"model.{written}: {err['msg']}, got {value!r}.")
    return ConfigError(" ".join(messages))
