"""The typed ``lr_scheduler`` section: one schema per scheduler type, registered with the config.

``load_config`` dispatches on ``lr_scheduler.type`` to the schema registered here, which validates
the section against training.steps and returns the :class:`~lmforge.lr.schedules.Schedule`
(``cfg.lr_scheduler.typed``); ``build_scheduler`` then uses it instead of validating again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmforge.config.registry import register_section_schema
from lmforge.lr.build import SCHEDULER_TYPES, schedule_of_values
from lmforge.lr.schedules import Schedule
from lmforge.utils.logging import get_logger

log = get_logger("lr")


def _schedule(section: Any, path: str, cfg: Mapping[str, Any]) -> Schedule:
    schedule = schedule_of_values(section.to_dict(), path, int(cfg["training"].steps))
    for note in schedule.warnings:  # load_config collects these into cfg.warnings
        log.warning("%s", note)
    return schedule


def register() -> None:
    """Register every scheduler type (idempotent)."""
    for name in SCHEDULER_TYPES:
        register_section_schema("lr_scheduler", name, _schedule, noun="scheduler")


register()
