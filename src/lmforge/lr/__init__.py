"""Learning-rate schedules: the ``lr_scheduler`` section of the YAML.

``load_config`` types the section through the schemas of :mod:`lmforge.lr.specs` (one per ``type``,
registered by :mod:`lmforge.lr.schema`; ``cfg.lr_scheduler.typed`` is the validated
``SchedulerSpec``); ``build_scheduler(section, total_steps)`` turns that typed section into a pure
schedule (``lr_at(step) -> float``); ``ScheduleLR(optimizer, schedule)`` drives a torch optimizer
with it.
"""

from typing import Any

from lmforge.lr.build import build_scheduler
from lmforge.lr.schedules import Schedule
from lmforge.lr.specs import SCHEDULER_TYPES, SchedulerSpec

__all__ = ["SCHEDULER_TYPES", "Schedule", "ScheduleLR", "SchedulerSpec", "build_scheduler"]


def __getattr__(name: str) -> Any:
    # ScheduleLR needs torch; `import lmforge` (which registers the lr schemas) should not.
    if name == "ScheduleLR":
        from lmforge.lr.torch_scheduler import ScheduleLR

        return ScheduleLR
    raise AttributeError(f"module 'lmforge.lr' has no attribute {name!r}")
