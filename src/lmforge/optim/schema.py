"""The typed ``optimizer`` section: one schema per optimizer type, registered with the config.

``load_config`` dispatches on ``optimizer.type`` to the schema registered here, which validates the
section into :class:`~lmforge.optim.options.OptimizerOptions` (``cfg.optimizer.typed``); an unknown
type falls to the catch-all, which refuses it with the valid types. The optimizers need torch, so
``lmforge/__init__.py`` registers :func:`register` as a provider, run on the first load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmforge.config.registry import register_section_schema
from lmforge.optim.options import OPTIMIZER_TYPES, OptimizerOptions, parse_optimizer_section


def _options(section: Any, path: str, cfg: Mapping[str, Any]) -> OptimizerOptions:
    return parse_optimizer_section(section)


def register() -> None:
    """Register every optimizer type and the catch-all (idempotent)."""
    for name in (*OPTIMIZER_TYPES, "*"):
        register_section_schema("optimizer", name, _options)
