"""The typed ``lr_scheduler`` section, registered with the config.

``load_config`` (and ``validate_section("lr_scheduler", ...)``) dispatches on ``lr_scheduler.type`` to
the schema registered here, which validates the keys the file wrote against that type's pydantic
schema (:mod:`lmforge.lr.specs`, one per type, discriminated on ``type``) and keeps the result on the
section (``cfg.lr_scheduler.typed``, a :class:`~lmforge.lr.specs.SchedulerSpec`). Once training.steps
is known, ``TrainConfig`` checks the schedule over it (:meth:`SchedulerSpec.check_against_training`).
Every message names the key by its full dotted path.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from lmforge.config.registry import register_section_schema
from lmforge.errors import ConfigError
from lmforge.lr.keys import KeyProblem
from lmforge.lr.specs import SCHEDULER_TYPES, SPEC_CLASSES, SchedulerSpec

if TYPE_CHECKING:
    from lmforge.config.sections_components import LrSchedulerConfig

_ANY_SCHEDULER = TypeAdapter(Annotated[Union[SPEC_CLASSES], Field(discriminator="type")])  # noqa: UP007


def validate_scheduler(values: Mapping[str, Any], path: str = "lr_scheduler") -> SchedulerSpec:
    """The typed scheduler of one ``lr_scheduler`` mapping (``path`` is its dotted name); one
    ConfigError names every problem. A key set to null counts as not set, as in the original."""
    written = {k: v for k, v in values.items() if v is not None}
    try:
        return _ANY_SCHEDULER.validate_python(written, context={"path": path})
    except ValidationError as exc:
        messages = _messages(exc, path, written)
        if len(messages) == 1:
            raise ConfigError(messages[0]) from None
        numbered = " ".join(f"({i}) {m}" for i, m in enumerate(messages, 1))
        raise ConfigError(f"{path} has {len(messages)} problems: {numbered}") from None


def _messages(exc: ValidationError, path: str, values: Mapping[str, Any]) -> list[str]:
    messages: list[str] = []
    unknown: list[str] = []
    for err in exc.errors():
        # The first place of a location is the union member (the type name); the rest are keys.
        keys = [str(part) for part in err["loc"][1:]]
        dotted = ".".join([path, *keys])
        kind = err["type"]
        if kind == "union_tag_not_found":
            messages.append(
                f"{path}.type is required: the scheduler to use, one of {', '.join(SCHEDULER_TYPES)}."
            )
        elif kind == "union_tag_invalid":
            messages.append(_unknown_type(values.get("type"), path))
        elif kind == "extra_forbidden":
            unknown.append(keys[-1])
        elif kind == "missing":
            type_name = str(values["type"])
            reason = SCHEDULER_TYPES[type_name].missing.get(keys[-1], "{type} requires it; it is not set.")
            messages.append(f"{dotted}: {reason.replace('{type}', type_name)}")
        elif kind == "value_error":
            problem = err["ctx"]["error"]
            if isinstance(problem, ConfigError):  # a nested scheduler, already named by its own path
                messages.append(str(problem))
            elif isinstance(problem, KeyProblem):
                messages.append(f"{dotted}.{problem.key}: {problem}")
            else:
                messages.append(f"{dotted}: {problem}")
        else:
            messages.append(f"{dotted}: {err['msg']}, got {err.get('input')!r}")
    if unknown:
        messages.insert(0, _unknown_keys(unknown, str(values["type"]), path))
    return messages


def _unknown_type(type_name: Any, path: str) -> str:
    close = difflib.get_close_matches(str(type_name), list(SCHEDULER_TYPES), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{path}.type: unknown scheduler {type_name!r}{hint}. Valid types: {', '.join(SCHEDULER_TYPES)}."


def _unknown_keys(unknown: list[str], type_name: str, path: str) -> str:
    """Keys this scheduler does not take (the original silently ignores them), each with a hint."""
    accepted = ["type", *SCHEDULER_TYPES[type_name].accepted_keys(), "total_steps"]
    parts = []
    for key in sorted(unknown):
        owners = [n for n, cls in SCHEDULER_TYPES.items() if n != type_name and key in cls.accepted_keys()]
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.75)
        hint = ""
        if owners:
            named = ", ".join(owners) if len(owners) <= 3 else f"{', '.join(owners[:2])} and others"
            hint = f" (it is a setting of {named})"
        elif close:
            hint = f" (did you mean {close[0]}?)"
        parts.append(f"{path}.{key}{hint}")
    noun = "is not a setting" if len(unknown) == 1 else "are not settings"
    return (
        f"{'; '.join(parts)} {noun} of {type_name}. {type_name} accepts: {', '.join(accepted)}. The original "
        f"silently ignores unknown keys, so a typo would change nothing; lmforge refuses it."
    )


def _typed(section: LrSchedulerConfig, path: str, cfg: Mapping[str, Any]) -> SchedulerSpec:
    return validate_scheduler(section.written_values(), path)


def register() -> None:
    """Register every scheduler type (idempotent)."""
    for name in SCHEDULER_TYPES:
        register_section_schema("lr_scheduler", name, _typed, noun="scheduler")


register()
