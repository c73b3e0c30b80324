"""``build_scheduler``: from the typed ``lr_scheduler`` section to the schedule over training.steps."""

from __future__ import annotations

from lmforge.config import LrSchedulerConfig
from lmforge.lr.schedules import Schedule
from lmforge.lr.specs import SchedulerSpec
from lmforge.utils.logging import get_logger

log = get_logger("lr")


def build_scheduler(section: LrSchedulerConfig, total_steps: int) -> Schedule:
    """The schedule of the typed ``lr_scheduler`` section over ``total_steps`` (training.steps, the
    scheduler's total whatever the YAML says).

    ``section`` is what ``load_config`` made (``cfg.lr_scheduler``); tools and tests type a mapping
    with ``lmforge.config.validate_section("lr_scheduler", mapping)``. Settings that have no effect
    (e.g. warmup_steps when warmup_ratio is also set) are logged as warnings and listed in
    ``schedule.warnings``.
    """
    spec = getattr(section, "typed", None)
    if not isinstance(section, LrSchedulerConfig) or not isinstance(spec, SchedulerSpec):
        raise TypeError(
            "build_scheduler takes the typed lr_scheduler section (load_config's cfg.lr_scheduler, or "
            f"lmforge.config.validate_section('lr_scheduler', mapping)), got {type(section).__name__}"
        )
    schedule = spec.schedule(total_steps)
    for note in schedule.warnings:
        log.warning("%s", note)
    return schedule
