"""The field types of the optimizer schemas: what one ``optimizer`` key may hold, and how a wrong
value is refused.

Each type is an ``Annotated`` pydantic type whose validator raises ``ValueError`` with the reason
only; :mod:`lmforge.optim.schema` puts the key's full dotted path in front (``optimizer.eps``). A
problem inside a key (one rule of ``lr_scale``, one beta) raises :class:`SubkeyProblem`, whose
``suffix`` is appended to that path (``optimizer.lr_scale.*emb*``, ``optimizer.betas[0]``). Where the
original MindFormers code has a message for the same mistake, the reason is that text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BeforeValidator

from lmforge.config.base import number_from_string

DEFAULT_ADAMW_INCLUDE = ("*word_embeddings*", "*output_layer*")
COMM_STRATEGIES = ("allgather", "allgather_deredundency")


class SubkeyProblem(ValueError):
    """A wrong value inside a key: ``suffix`` (``.rule`` or ``[i]``) extends the key's dotted path."""

    def __init__(self, suffix: str, reason: str) -> None:
        super().__init__(reason)
        self.suffix = suffix


def as_float(value: Any) -> float:
    # The original requires floats (``weight_decay: 0`` fails there); an int is a number, so we take it,
    # and so is a number written as a string (``"1e-8"``), as every float key of the config takes it.
    value = number_from_string(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {type(value).__name__} ({value!r}).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}.")
    return value


def _as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {type(value).__name__} ({value!r}).")
    return value


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {type(value).__name__} ({value!r}).")
    return value


def _betas(value: Any) -> tuple[float, float]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"expected a list of 2 numbers [beta1, beta2], got {value!r}.")
    betas = []
    for i, v in enumerate(value):
        try:
            betas.append(as_float(v))
        except ValueError as exc:
            raise SubkeyProblem(f"[{i}]", str(exc)) from None
    for i, v in enumerate(betas):
        if not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {v}, should be >= 0 and < 1.")
    return betas[0], betas[1]


def _eps(value: Any) -> float:
    v = as_float(value)
    if v < 0:
        raise ValueError(f"Invalid epsilon value: {v}, should be >= 0.")
    # The spec requires eps > 0; the original (and torch) take 0, where a parameter whose gradient is
    # exactly 0 (an unseen token's embedding row) is updated by 0/0 = NaN.
    if v == 0:
        raise ValueError(
            "must be > 0 (e.g. 1.0e-8): with eps 0, a parameter whose gradient is 0 gets a NaN update (0/0)."
        )
    return v


def _weight_decay(value: Any) -> float:
    v = as_float(value)
    if v < 0:
        raise ValueError(f"Invalid weight_decay value: {v}, should be >= 0.")
    return v


def _rule_list(key: str):
    def check(value: Any) -> list[str]:
        if value is None:
            return []
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key} should be a list of strings, but got {type(value).__name__}.")
        for item in value:
            if not isinstance(item, str):
                raise ValueError(f"All items in {key} should be strings, but got {type(item).__name__}.")
        return list(value)

    return check


def _rule_values(value: Any, example: str, what: str) -> list[tuple[str, float]]:
    """A mapping from parameter-name rule to a number, in the file's order (first match wins)."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise ValueError(
            f"expected a mapping from parameter-name rule (exact name, substring or glob) to {what}, "
            f"e.g. {example}; got {type(value).__name__}."
        )
    rules = []
    for rule, number in value.items():
        if not isinstance(rule, str):
            raise ValueError(f"rule {rule!r} must be a string.")
        try:
            rules.append((rule, as_float(number)))
        except ValueError as exc:
            raise SubkeyProblem(f".{rule}", str(exc)) from None
    return rules


def _lr_scale(value: Any) -> list[tuple[str, float]]:
    """``lr_scale: {"*word_embeddings*": 0.5, ...}``: per-name-pattern lr multipliers."""
    rules = _rule_values(value, '{"*word_embeddings*": 0.5}', "a positive lr multiplier")
    for rule, scale in rules:
        if scale <= 0:
            raise SubkeyProblem(f".{rule}", f"the lr multiplier must be > 0, got {scale}.")
    return rules


def _weight_decay_values(value: Any) -> list[tuple[str, float]]:
    """``weight_decay_values: {"*word_embeddings*": 0.02, ...}``: per-name-pattern decay values."""
    example = '{"*word_embeddings*": 0.02, "decoder.layers": 0.01}'
    rules = _rule_values(value, example, "a weight decay >= 0")
    for rule, wd in rules:
        if wd < 0:
            raise SubkeyProblem(f".{rule}", f"Invalid weight_decay value: {wd}, should be >= 0.")
    return rules


def _adamw_include(value: Any) -> list[str]:
    if value is None:
        return list(DEFAULT_ADAMW_INCLUDE)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError("adamw_include must be a list of glob strings.")
    return list(value)


def _ns_dtype(value: Any) -> str:
    if value not in ("bfloat16", "float32"):
        raise ValueError(f"expected 'bfloat16' or 'float32', got {value!r}.")
    return value


def _moment_dtype(value: Any) -> str:
    if value not in ("float32", "bfloat16"):
        raise ValueError(
            f"expected 'float32' (default) or 'bfloat16' (moments stored in bf16, updated in fp32 with "
            f"stochastic rounding), got {value!r}."
        )
    return value


def _comm_strategy(value: Any) -> str:
    if value not in COMM_STRATEGIES:
        raise ValueError(f"comm_strategy must be 'allgather' or 'allgather_deredundency', got {value!r}.")
    return value


Number = Annotated[float, BeforeValidator(as_float)]
Bool = Annotated[bool, BeforeValidator(_as_bool)]
Int = Annotated[int, BeforeValidator(_as_int)]
Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]
Eps = Annotated[float, BeforeValidator(_eps)]
WeightDecay = Annotated[float, BeforeValidator(_weight_decay)]
IncludeRules = Annotated[list[str], BeforeValidator(_rule_list("weight_decay_include"))]
ExcludeRules = Annotated[list[str], BeforeValidator(_rule_list("weight_decay_exclude"))]
LrScale = Annotated[list[tuple[str, float]], BeforeValidator(_lr_scale)]
WeightDecayValues = Annotated[list[tuple[str, float]], BeforeValidator(_weight_decay_values)]
AdamwInclude = Annotated[list[str], BeforeValidator(_adamw_include)]
NsDtype = Annotated[str, BeforeValidator(_ns_dtype)]
MomentDtype = Annotated[str, BeforeValidator(_moment_dtype)]
CommStrategy = Annotated[str, BeforeValidator(_comm_strategy)]


class KeyProblem(ValueError):
    """A check across the keys of one optimizer that blames one of them (Muon's ``swap``, the QK-Clip
    threshold of an enabled clip): the schema names ``key`` by its dotted path."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key
