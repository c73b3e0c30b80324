"""Learning-rate schedules: the ``lr_scheduler`` section of the YAML.

``build_scheduler(section, total_steps)`` validates the section and returns a pure schedule
(``lr_at(step) -> float``); ``ScheduleLR(optimizer, schedule)`` drives a torch optimizer with it.
"""

from lmforge.lr.build import SCHEDULER_TYPES, build_scheduler, validate_scheduler_section
from lmforge.lr.schedules import Schedule
from lmforge.lr.torch_scheduler import ScheduleLR

__all__ = ["SCHEDULER_TYPES", "Schedule", "ScheduleLR", "build_scheduler", "validate_scheduler_section"]
