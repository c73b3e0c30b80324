"""Builders take one config section: a validated pydantic model or a plain mapping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def section_to_dict(section: Any) -> dict[str, Any]:
    """A plain, deep-copied dict of a config section (pydantic model, mapping, or None)."""
    import copy

    if section is None:
        return {}
    if hasattr(section, "to_dict"):
        return copy.deepcopy(section.to_dict())
    if hasattr(section, "model_dump"):
        return copy.deepcopy(section.model_dump())
    if isinstance(section, Mapping):
        return copy.deepcopy(dict(section))
    raise TypeError(f"expected a config section (mapping or pydantic model), got {type(section).__name__}")
