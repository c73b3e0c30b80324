"""The typed ``model`` section: every family's schema, registered with the config.

``load_config`` dispatches on ``model.model_type``: each registered family (and alias) maps to the
schema below, which resolves the section through that family's keys (models/common/config_keys.py)
into a :class:`TypedModel` (``cfg.model.typed``). An unknown ``model_type`` falls to the catch-all
schema, which reports it with the known types. Importing the families needs torch, so
``lmforge/__init__.py`` registers :func:`register` as a provider, run on the first load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from lmforge.config.registry import register_section_expander, register_section_schema
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.pretrained import expand_from_pretrained
from lmforge.models.registry import families, model_type_aliases, resolve


class TypedModel(NamedTuple):
    """A validated model section: the structure and the model class ``architectures`` names."""

    config: TransformerConfig
    model_class: type[GPTModel]


def _typed_model(section: Any, path: str, cfg: Mapping[str, Any]) -> TypedModel:
    config, cls = resolve(section.to_dict())
    return TypedModel(config, cls)


def register() -> None:
    """Register every discovered family and alias (idempotent)."""
    for name in (*families(), *model_type_aliases()):
        register_section_schema("model", name, _typed_model)
    register_section_schema("model", "*", _typed_model)
    register_section_expander("model", expand_from_pretrained)
