"""Typed schemas of the sections whose shape depends on a discriminator (``lr_scheduler.type``, ...).

The config package imports nothing from the project, yet the keys of ``lr_scheduler`` depend on the
scheduler its ``type`` names. The package that owns a section registers, at import, one schema per
discriminator value (``lmforge/__init__.py`` imports those packages, so they are registered before
``load_config`` runs); ``TrainConfig`` dispatches on the discriminator while it validates and keeps
the typed result on the section (``section.typed``).

A schema is a callable ``schema(section, path, cfg) -> typed value``: ``section`` is the validated
section, ``path`` its dotted name, ``cfg`` the sections of ``TrainConfig`` validated before it (a
mapping of section name to section). It raises ``ValueError`` (``ConfigError`` is one) whose text
names the dotted key. A schema registered under ``"*"`` takes every value no other schema takes
(the model section: its families resolve ``model_type`` and aliases themselves, with their own
messages). The model section's keys are its family's, not ``ModelConfig``'s: its schema gets the
section's keys as a plain mapping (``ModelConfig`` passes them). A package whose import is costly (torch) registers a *provider* instead: a callable run
on the first validation of that section, which registers the schemas.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

SectionSchema = Callable[[Any, str, Mapping[str, Any]], Any]

_SCHEMAS: dict[str, dict[str, SectionSchema]] = {}
_NOUNS: dict[str, str] = {}
_PROVIDERS: dict[str, list[Callable[[], None]]] = {}
_EXPANDERS: dict[str, Callable[[Any], Any]] = {}


def register_section_schema(
    section: str, discriminator_value: str, schema: SectionSchema, noun: str = ""
) -> None:
    """Make ``schema`` the typed form of ``section`` when its discriminator is ``discriminator_value``.

    ``noun`` names what the discriminator picks in the unknown-value message ("scheduler").
    Registering the same schema again is a no-op; another schema under a taken value is an error.
    """
    known = _SCHEMAS.setdefault(section, {})
    owner = known.get(discriminator_value)
    if owner is not None and owner is not schema:
        raise ValueError(f"{section}: a schema for {discriminator_value!r} is already registered.")
    known[discriminator_value] = schema
    if noun:
        _NOUNS[section] = noun


def register_schema_provider(section: str, provider: Callable[[], None]) -> None:
    """Run ``provider`` (which registers the schemas of ``section``) when ``section`` is first validated."""
    pending = _PROVIDERS.setdefault(section, [])
    if provider not in pending:
        pending.append(provider)


def _schemas(section: str) -> dict[str, SectionSchema]:
    pending = _PROVIDERS.pop(section, [])
    for provider in pending:
        provider()
    return _SCHEMAS.get(section, {})


def section_values(section: str) -> tuple[str, ...]:
    """The discriminator values registered for ``section`` (in registration order)."""
    return tuple(v for v in _schemas(section) if v != "*")


def typed_section(section: str, value: Any, node: Any, path: str, cfg: Mapping[str, Any]) -> Any:
    """The typed form of ``node`` (its discriminator is ``value``), or None when nothing registered
    a schema for ``section`` (the config package used on its own)."""
    known = _schemas(section)
    if not known:
        return None
    if "*" in known and not (isinstance(value, str) and value in known):
        return known["*"](node, path, cfg)
    if not isinstance(value, str) or value not in known:
        close = difflib.get_close_matches(str(value), list(known), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        noun = _NOUNS.get(section, "type")
        raise ValueError(f"{path}.type: unknown {noun} {value!r}{hint}. Valid types: {', '.join(known)}.")
    return known[value](node, path, cfg)


def register_section_expander(section: str, expander: Callable[[Any], Any]) -> None:
    """Make ``expander(raw) -> raw`` run on ``section``'s raw mapping before it is validated (the model
    section's ``from_pretrained``, which models/ expands from a config.json)."""
    _EXPANDERS[section] = expander


def expand_section(section: str, raw: Any) -> Any:
    """``raw`` as the registered expander of ``section`` rewrites it (unchanged when none is)."""
    _schemas(section)  # runs the providers, which register the expander
    expander = _EXPANDERS.get(section)
    return raw if expander is None else expander(raw)
