"""Optimizers: AdamW, Muon, Lion and LAMB on fp32 parameters (the master weights), built from the ``optimizer`` section.

``build_optimizer(section, model, lr)`` returns a ``torch.optim.Optimizer``; see ``docs/optim.md``.
"""

from lmforge.optim.adamw import AdamW
from lmforge.optim.builder import build_optimizer
from lmforge.optim.lamb import LAMB
from lmforge.optim.lion import Lion
from lmforge.optim.muon import Muon
from lmforge.optim.newton_schulz import newton_schulz, normalize_ns_schedule
from lmforge.optim.schema import validate_optimizer
from lmforge.optim.specs import OptimizerOptions
from lmforge.optim.update_rule import UpdateRuleOptimizer

__all__ = [
    "LAMB",
    "AdamW",
    "Lion",
    "Muon",
    "OptimizerOptions",
    "UpdateRuleOptimizer",
    "build_optimizer",
    "newton_schulz",
    "normalize_ns_schedule",
    "validate_optimizer",
]
