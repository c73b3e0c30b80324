"""The families lmforge knows: each registers itself; this module finds them and resolves sections.

Discovery (on first use): every subpackage of ``lmforge.models`` except ``common`` is imported (a
family's ``__init__.py`` calls :func:`register`), then every entry point of the group
``lmforge.models`` is loaded (a module that registers on import, or a ``Family`` object).

As in the original, ``model_type`` picks the configuration class and ``architectures`` (a string, or
the first element of a list) picks the model class; here the pair must also agree.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, NamedTuple

from lmforge.errors import ConfigError
from lmforge.models.common.config_checks import check_transformer_config
from lmforge.models.common.gpt import GPTModel
from lmforge.models.common.section import FamilySection, validate_family_section
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.family import Family

ENTRY_POINT_GROUP = "lmforge.models"
_FAMILIES: dict[str, Family] = {}
_ALIASES: dict[str, str] = {}
_discovered = False


def register(family: Family) -> Family:
    """Make ``family`` known under its model_type and aliases. Registering the same object again is a
    no-op; another family under a taken name is an error."""
    for name in (family.model_type, *family.aliases):
        owner = _FAMILIES.get(_ALIASES.get(name, name))
        if owner is not None and owner is not family:
            raise ValueError(f"model_type {name!r} is already registered (family {owner.model_type!r}).")
    for arch in family.model_classes:
        other = next((f for f in _FAMILIES.values() if f is not family and arch in f.model_classes), None)
        if other is not None:
            raise ValueError(f"architecture {arch!r} is already registered by family {other.model_type!r}.")
    _FAMILIES[family.model_type] = family
    _ALIASES.update(dict.fromkeys(family.aliases, family.model_type))
    return family


def unregister(model_type: str) -> None:
    family = _FAMILIES.pop(model_type, None)
    if family is not None:
        for alias in family.aliases:
            _ALIASES.pop(alias, None)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    import lmforge.models as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.ispkg and info.name != "common":
            importlib.import_module(f"{package.__name__}.{info.name}")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
        except Exception as exc:  # a broken plugin is named, not a traceback from importlib
            raise ConfigError(
                f"the model family entry point {ep.name!r} ({ep.value}) of group '{ENTRY_POINT_GROUP}' failed "
                f"to load: {type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(loaded, Family):
            register(loaded)


def families() -> dict[str, Family]:
    """model_type → Family, every discovered and registered family."""
    _discover()
    return dict(_FAMILIES)


def model_type_aliases() -> dict[str, str]:
    _discover()
    return dict(_ALIASES)


def architectures() -> dict[str, type[GPTModel]]:
    """Architecture name → model class, over all families."""
    return {name: cls for f in families().values() for name, cls in f.model_classes.items()}


def family_for(model_type: Any) -> Family:
    known = families()
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f"model.model_type is required (got {model_type!r}); known model types: {', '.join(sorted(known))}."
        )
    name = _ALIASES.get(model_type, model_type)
    if name not in known:
        raise ConfigError(
            f"model.model_type = {model_type!r} is not a known model type; known: "
            f"{', '.join(sorted([*known, *_ALIASES]))}."
        )
    return known[name]


def architecture_name(raw: Any, family: Family) -> str:
    arch = raw[0] if isinstance(raw, (list, tuple)) and raw else raw
    if not isinstance(arch, str) or not arch:
        raise ConfigError(
            f"model.architectures is required (got {raw!r}); for model_type '{family.model_type}' use "
            f"{' or '.join(family.keys.architectures)}."
        )
    if arch not in family.keys.architectures:
        known = architectures()
        if arch not in known:
            raise ConfigError(
                f"model.architectures = {arch!r} is not a known architecture; for model_type "
                f"'{family.model_type}' use {' or '.join(family.keys.architectures)} (known: "
                f"{', '.join(sorted(known))})."
            )
        raise ConfigError(
            f"model.architectures = {arch!r} does not match model.model_type = '{family.model_type}'; "
            f"use {' or '.join(family.keys.architectures)}."
        )
    return arch


class TypedModel(NamedTuple):
    """A validated model section: the family's typed section, the structure built from it, and the
    model class ``architectures`` names."""

    section: FamilySection
    config: TransformerConfig
    model_class: type[GPTModel]


def resolve(raw: Mapping[str, Any]) -> TypedModel:
    """A model section as given (the YAML's, or one made from a Hugging Face config.json) validated by
    its family's typed schema, with the structure built from it. ConfigError names ``model.<key>``."""
    family = family_for(raw.get("model_type"))
    arch = architecture_name(raw.get("architectures"), family)
    section = validate_family_section(dict(raw), family.keys, arch)
    cfg = family.to_transformer_config(section)
    cfg.section = dict(raw)
    # Dimensions and numeric domains the model relies on, whatever family built the structure.
    # MLA families have no head_dim key.
    check_transformer_config(cfg, head_dim_given=bool(getattr(section, "head_dim", None)))
    return TypedModel(section, cfg, family.model_classes[arch])
