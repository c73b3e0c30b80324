"""Base classes and field types of the ``train.yaml`` schema.

Types are strict: a bool is never a number and a string is never coerced, except that a float field
accepts an int and a number written as a string (``"1e-8"``, which YAML 1.1 reads as a string).
Sections marked *open* keep unknown keys (the original's ``allow_extra``); they are readable as
attributes and included in ``to_dict()``. Every rule raises ``ValueError`` whose text starts with
the full dotted path of the key; ``load`` turns pydantic's errors into one ConfigError.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def number_from_string(value: Any) -> Any:
    """``value`` as a float when it is a number written as a string, else unchanged."""
    # YAML 1.1 reads ``1e-8`` (no dot) as a string; the spec's users write it, so it counts as a float.
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        return float(value.strip())
    return value


Float = Annotated[float, BeforeValidator(number_from_string)]


class Section(BaseModel):
    """A strict section: unknown keys are errors, values are type-checked, objects are frozen."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, protected_namespaces=())

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of this section, nested sections and extras included."""
        return self.model_dump(mode="python")

    def written_values(self) -> dict[str, Any]:
        """The keys the file wrote (fields it set and extras) as plain values: what a schema registered
        per discriminator (lmforge.config.registry) validates, since one type's defaults are not
        another's."""
        dumped = self.to_dict()
        written = set(self.model_fields_set) | set(self.__pydantic_extra__ or {})
        return {k: v for k, v in dumped.items() if k in written}

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a field or extra key (an extra named like a pydantic method, e.g. ``schema``,
        is only reachable this way or with ``section[key]``)."""
        extra = self.__pydantic_extra__ or {}
        if key in extra:
            return extra[key]
        if key in type(self).model_fields:
            return getattr(self, key)
        return default

    def __getitem__(self, key: str) -> Any:
        extra = self.__pydantic_extra__ or {}
        if key in extra or key in type(self).model_fields:
            return self.get(key)
        raise KeyError(f"'{type(self).__name__}' object has no key '{key}'")


class OpenSection(Section):
    """A section whose undeclared keys pass through to the component that reads it (``allow_extra``)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, protected_namespaces=())

    @model_validator(mode="after")
    def _nest_extra_mappings(self) -> OpenSection:
        # Like the original, a nested mapping among the extras becomes a config object, so that
        # ``cfg.train_dataset.dataloader.config.seq_length`` works; to_dict() turns it back.
        extra = self.__pydantic_extra__ or {}
        for key, value in list(extra.items()):
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                extra[key] = ConfigNode.model_validate(value)
        return self

    def extras(self) -> dict[str, Any]:
        """The undeclared keys of this section (plain values)."""
        dumped = self.to_dict()
        return {k: dumped[k] for k in (self.__pydantic_extra__ or {})}


class ConfigNode(OpenSection):
    """A nested mapping inside an open section: any keys, attribute access, plain dict via to_dict()."""


def check_positive(value: Any, path: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{path} must be positive, got {value}")


def check_one_of(value: Any, path: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{path} must be one of {', '.join(repr(v) for v in valid)}; got {value!r}")
