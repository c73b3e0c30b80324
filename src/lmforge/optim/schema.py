"""The typed ``optimizer`` section, registered with the config.

``load_config`` (and ``validate_section("optimizer", ...)``) dispatches on ``optimizer.type`` to the
schema registered here, which validates the keys the file wrote against that type's pydantic schema
(:mod:`lmforge.optim.specs`, one per type, discriminated on ``type``) and keeps the result on the
section (``cfg.optimizer.typed``, an :class:`~lmforge.optim.specs.OptimizerOptions`). Only the
written keys are validated, so a key the file omits takes its type's own default. An unknown type
falls to the catch-all, which refuses it with the valid types. Every message names the key by its
full dotted path. The optimizers need torch, so ``lmforge/__init__.py`` registers :func:`register`
as a provider, run on the first load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from lmforge.config.registry import register_section_schema
from lmforge.errors import ConfigError
from lmforge.optim.fields import KeyProblem, SubkeyProblem
from lmforge.optim.specs import OPTIMIZER_TYPES, SPEC_CLASSES, OptimizerOptions, OptimizerSpec
from lmforge.utils.logging import get_logger

if TYPE_CHECKING:
    from lmforge.config.sections_components import OptimizerConfig

logger = get_logger("lmforge.optim")

_ANY_OPTIMIZER = TypeAdapter(Annotated[Union[SPEC_CLASSES], Field(discriminator="type")])  # noqa: UP007


def validate_optimizer(written: Mapping[str, Any], path: str = "optimizer") -> OptimizerOptions:
    """The typed optimizer of the keys one ``optimizer`` section wrote (``path`` is its dotted name;
    ``type`` defaults to AdamW). One ConfigError names every problem; keys no schema of the type
    takes, and settings that have no effect, are warned about."""
    values = {"type": "AdamW", **written}
    if not isinstance(values["type"], str) or values["type"] not in OPTIMIZER_TYPES:
        raise ConfigError(f"{path}.type: {_unknown_type(values['type'])}")
    try:
        spec: OptimizerSpec = _ANY_OPTIMIZER.validate_python(values)
    except ValidationError as exc:
        messages = _messages(exc, path)
        if len(messages) == 1:
            raise ConfigError(messages[0]) from None
        numbered = " ".join(f"({i}) {m}" for i, m in enumerate(messages, 1))
        raise ConfigError(f"{path} has {len(messages)} problems: {numbered}") from None
    ignored = sorted(set(written) - set(spec.accepted_keys()))
    _warn_inert(spec, set(written), ignored, path)
    return OptimizerOptions(type=spec.type, grouping=spec.grouping(), hyper=spec, ignored_keys=ignored)


def _unknown_type(type_name: Any) -> str:
    return f"Optimizer type {type_name} is not implemented yet. Valid types: {', '.join(OPTIMIZER_TYPES)}."


def _messages(exc: ValidationError, path: str) -> list[str]:
    messages = []
    for err in exc.errors():
        # The first place of a location is the union member (the type name); the rest are keys.
        dotted = ".".join([path, *(str(part) for part in err["loc"][1:])])
        problem = err.get("ctx", {}).get("error")
        if isinstance(problem, KeyProblem):
            messages.append(f"{dotted}.{problem.key}: {problem}")
        elif isinstance(problem, SubkeyProblem):
            messages.append(f"{dotted}{problem.suffix}: {problem}")
        elif isinstance(problem, ValueError):
            messages.append(f"{dotted}: {problem}")
        else:
            messages.append(f"{dotted}: {err['msg']}, got {err.get('input')!r}")
    return messages


def _warn_inert(spec: OptimizerSpec, given: set[str], ignored: list[str], path: str) -> None:
    """Warn about each written setting that changes nothing (the original ignores them silently)."""
    if "accumulate_allreduce_grads_in_fp32" in given and spec.accumulate_allreduce_grads_in_fp32 is False:
        logger.warning(
            "%s.accumulate_allreduce_grads_in_fp32: false has no effect; gradients of bf16/fp16 "
            "parameters always accumulate and reduce in fp32 (as in the original since it removed the switch).",
            path,
        )
    for key in sorted(set(spec.KERNEL_KEYS) & given):
        logger.warning(
            "%s.%s = %r has no effect: lmforge picks its own kernel (torch's fused AdamW on the fp32 masters).",
            path,
            key,
            getattr(spec, key),
        )
    for key in ignored:
        hint = (
            " (Muon's AdamW branch uses adamw_betas / adamw_eps)"
            if spec.type == "Muon" and key == "betas"
            else ""
        )
        logger.warning(
            "%s.%s is not used by the %s optimizer and has no effect%s.", path, key, spec.type, hint
        )


def _options(section: OptimizerConfig, path: str, cfg: Mapping[str, Any]) -> OptimizerOptions:
    return validate_optimizer(section.written_values(), path)


def register() -> None:
    """Register every optimizer type and the catch-all (idempotent)."""
    for name in (*OPTIMIZER_TYPES, "*"):
        register_section_schema("optimizer", name, _options)
