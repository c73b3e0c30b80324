"""The field types of the scheduler schemas: what one ``lr_scheduler`` key may hold, and how a wrong
value is refused.

Each type is an ``Annotated`` pydantic type whose validator raises ``ValueError`` with the reason
only; :mod:`lmforge.lr.schema` puts the key's full dotted path in front (``lr_scheduler.warmup_steps``,
or ``lr_scheduler.base_lr.warmup_steps`` inside a LearningRateWiseLayer). Where the original
MindFormers code has an exact message for the same mistake, the reason contains that text. A key
left out, or set to null, is not set: the schema drops null values before validation, as the
original treats them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationInfo

from lmforge.config.base import number_from_string

# A product ratio × total that lies this close to a whole number counts as that number, so that
# 0.29 × 100 gives 29 warm-up steps (binary floating point gives 28.999999999999996).
_WHOLE_NUMBER_TOLERANCE = 1e-9

LR = "a learning rate"


def floor_ratio_of(ratio: float, total_steps: int) -> int:
    """``floor(ratio × total_steps)``, immune to the rounding error of the float product."""
    product = ratio * total_steps
    nearest = round(product)
    if abs(product - nearest) <= _WHOLE_NUMBER_TOLERANCE * max(1.0, abs(product)):
        return int(nearest)
    return math.floor(product)


class KeyProblem(ValueError):
    """A check of the whole scheduler that blames one of its keys (a required key that is not set,
    lr_end against learning_rate): the schema names ``key`` by its dotted path."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key


def show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scheduler(info: ValidationInfo) -> str:
    # ``type`` is every schema's first field, validated before the others.
    return str(info.data.get("type", "this scheduler"))


def _steps(tag: str) -> Callable[[Any, ValidationInfo], int]:
    def check(value: Any, info: ValidationInfo) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"The type of {tag}_step must be int, but got {type(value)}. {_scheduler(info)} needs a whole "
                f"number of steps >= 0 here, got {show(value)}."
            )
        if value < 0:
            raise ValueError(
                f"The {tag}_step must be >= 0, but got {value}. Give a whole number of steps >= 0."
            )
        return value

    return check


def _total_steps(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            f"must be a whole number of steps equal to training.steps (or left out: the total always comes "
            f"from training.steps), got {show(value)}."
        )
    return value


def _ratio(tag: str) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if not _is_number(value):
            raise ValueError(
                f"The type of {tag}_ratio must be float or int, but got {type(value)}. Give a number in "
                f"[0, 1] (a fraction of training.steps), got {show(value)}."
            )
        if not (0.0 <= value <= 1.0):  # also refuses NaN
            raise ValueError(
                f"The {tag}_ratio's value range must be in [0,1], but got {value}. It is a fraction of "
                f"training.steps."
            )
        return float(value)

    return check


def _number(what: str, minimum: float | None) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        value = number_from_string(value)  # "1e-5" counts, as in every float key of the config
        if not _is_number(value):
            raise ValueError(f"must be {what}, got {show(value)}.")
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value!r}: it would make the lr NaN or inf.")
        if minimum is not None and value < minimum:
            raise ValueError(f"must be {what} >= {minimum:g}, got {value!r}.")
        return float(value)

    return check


def _positive(original_message: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{original_message.format(value=value)}. Give an integer >= 1, got {show(value)}."
            )
        return value

    return check


def Steps(tag: str) -> Any:  # noqa: N802 (a type, named like one)
    """A whole number of steps >= 0; ``tag`` gives the original's wording (``warmup`` -> warmup_step)."""
    return Annotated[int, BeforeValidator(_steps(tag))]


TotalSteps = Annotated[int, BeforeValidator(_total_steps)]


def Ratio(tag: str) -> Any:  # noqa: N802
    """A fraction of training.steps in [0, 1]."""
    return Annotated[float, BeforeValidator(_ratio(tag))]


def Number(what: str, minimum: float | None = 0.0) -> Any:  # noqa: N802
    """A finite float >= ``minimum`` (inclusive: learning rates are never negative)."""
    return Annotated[float, BeforeValidator(_number(what, minimum))]


def PositiveInt(original_message: str) -> Any:  # noqa: N802
    """An integer >= 1 (``t_max``, ``t_0``, ``t_mult``); ``original_message`` is the original's text."""
    return Annotated[int, BeforeValidator(_positive(original_message))]


LearningRate = Number(LR)
