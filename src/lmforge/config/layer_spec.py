"""Layer-spec strings of recompute, recompute_comm and swap: ``'5'`` or ``'0-3'`` (inclusive).

The original accepts a bare int too (``str(v).strip()`` is matched), and YAML reads an unquoted
``[0-3]`` as the string ``"0-3"``, so both forms are accepted here. Specs of one list must be strictly
ascending and must not overlap; layer ids are checked against the model's layer count (decoder layers
plus MTP layers, MTP layer i having id ``num_layers + i``) once the model is known.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_SPEC = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_layer_spec(value: Any, label: str) -> tuple[int, int]:
    """``(lo, hi)`` of one spec, inclusive on both ends; ``label`` is the dotted path for errors."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(
            f"{label}: invalid layer spec {value!r}; expected one non-negative integer or 'start-end' "
            "(e.g. '5', '0-19')"
        )
    match = _SPEC.match(str(value).strip())
    if match is None:
        raise ValueError(
            f"{label}: invalid layer spec {value!r}; expected one non-negative integer or 'start-end' "
            "(e.g. '5', '0-19')"
        )
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) is not None else lo
    if lo > hi:
        raise ValueError(f"{label}: range start must be <= end, got {value!r}")
    return lo, hi


def parse_layer_specs(values: Any, label: str) -> list[tuple[int, int]]:
    """Parse a list of specs and check that they are strictly ascending and do not overlap."""
    if isinstance(values, (str, int)) and not isinstance(values, bool):
        raise ValueError(
            f"{label} must be a list of layer specs such as ['0-3'] or ['0', '5'], got {values!r}; "
            "write it as a YAML list"
        )
    if not isinstance(values, Sequence):
        raise ValueError(
            f"{label} must be a list of layer specs such as ['0-3'], got {type(values).__name__}"
        )
    ranges: list[tuple[int, int]] = []
    for i, value in enumerate(values):
        lo, hi = parse_layer_spec(value, f"{label}[{i}]")
        if ranges and lo <= ranges[-1][1]:
            raise ValueError(
                f"{label}: layer specs must be in strictly ascending order; spec[{i}] '{value}' starts at "
                f"{lo} but previous spec ends at {ranges[-1][1]}"
            )
        ranges.append((lo, hi))
    return ranges


def check_layer_range(
    ranges: list[tuple[int, int]], values: Sequence[Any], num_layers: int, label: str
) -> None:
    """Every layer id lies in ``[0, num_layers - 1]``."""
    for i, (_, hi) in enumerate(ranges):
        if hi > num_layers - 1:
            raise ValueError(
                f"{label}[{i}]: layer id {hi} out of range [0, {num_layers - 1}], got {values[i]!r} "
                f"(the model has {num_layers} layers, counting MTP layers)"
            )


def expand_layer_specs(values: Sequence[Any], label: str = "layers") -> list[int]:
    """All layer ids a spec list names, ascending (``['0-2', '5']`` -> ``[0, 1, 2, 5]``)."""
    return [layer for lo, hi in parse_layer_specs(values, label) for layer in range(lo, hi + 1)]
