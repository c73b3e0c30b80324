"""Self-healing training (the ``recovery:`` section): roll back to the newest safe checkpoint and go on.

``detector.py`` decides when (the live doctor's spike and divergence rules, the skip policy's limit),
``safe_checkpoint.py`` which checkpoint is safe, ``controller.py`` the vote, the rollback and the
lowered learning rate after it; ``checks.py`` refuses settings recovery cannot honour before anything
is built. docs/training.md, "Recovery".
"""

from lmforge.train.recovery.checks import check_recovery
from lmforge.train.recovery.controller import Recovery, build_recovery
from lmforge.train.recovery.detector import Anomaly, AnomalyDetector

__all__ = ["Anomaly", "AnomalyDetector", "Recovery", "build_recovery", "check_recovery"]
