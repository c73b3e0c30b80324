"""Typed ``lr_scheduler`` sections for the tests that write theirs as mappings."""

from __future__ import annotations

from typing import Any

from lmforge.config import validate_section


def typed(section: dict[str, Any]) -> Any:
    """The typed section ``build_scheduler`` takes, validated as load_config validates it."""
    return validate_section("lr_scheduler", section)
