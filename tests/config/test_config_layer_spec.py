"""Layer specs: '5' and '0-3' (inclusive), ascending, non-overlapping."""

from __future__ import annotations

import pytest

from lmforge.config import expand_layer_specs, parse_layer_spec


def test_ranges_are_inclusive() -> None:
    assert parse_layer_spec("0-3", "x") == (0, 3)
    assert expand_layer_specs(["0-3"]) == [0, 1, 2, 3]
    assert expand_layer_specs(["0", "2-3", 5]) == [0, 2, 3, 5]


@pytest.mark.parametrize("bad", ["-1", "1-", "a", "1-2-3", "", True, 1.5, None])
def test_bad_specs(bad: object) -> None:
    with pytest.raises(ValueError, match=r"x: invalid layer spec"):
        parse_layer_spec(bad, "x")


def test_a_bare_string_is_not_a_list() -> None:
    with pytest.raises(ValueError, match="write it as a YAML list"):
        expand_layer_specs("0-3", "recompute.full_recompute_layer")  # type: ignore[arg-type]
