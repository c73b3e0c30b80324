"""The typed ``model`` section: every family's schema, registered with the config.

``load_config`` (and ``validate_section("model", ...)``) dispatch on ``model.model_type``: each
registered family (and alias) maps to the schema below, which validates the section by that family's
typed schema (``models/common/section.py``) into a :class:`TypedModel` (``cfg.model.typed``: the
typed section, its ``TransformerConfig`` and the model class). An unknown ``model_type`` falls to the
catch-all schema, which reports it with the known types. Importing the families needs torch, so
``lmforge/__init__.py`` registers :func:`register` as a provider, run on the first load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmforge.config.registry import register_section_expander, register_section_schema
from lmforge.models.pretrained import expand_from_pretrained
from lmforge.models.registry import TypedModel, families, model_type_aliases, resolve

__all__ = ["TypedModel", "register"]


def _typed_model(section: Mapping[str, Any], path: str, cfg: Mapping[str, Any]) -> TypedModel:
    # The model section's keys are its family's: config/ hands over the keys as the file gave them.
    return resolve(section)


def register() -> None:
    """Register every discovered family and alias (idempotent)."""
    for name in (*families(), *model_type_aliases()):
        register_section_schema("model", name, _typed_model)
    register_section_schema("model", "*", _typed_model)
    register_section_expander("model", expand_from_pretrained)
