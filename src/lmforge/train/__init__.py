"""The trainer. Its top level is the loop (``trainer.py``), the step (``step.py``) and checkpointing with
resume (the ``checkpoint`` package); everything beside the step — monitoring, profiling, evaluation, the
doctor, trackers — lives under ``callbacks/`` together with the code it runs.

``build_trainer(cfg, output_dir=None, device=None)`` builds everything a run needs from a
``TrainConfig`` (one process or under torchrun); ``trainer.fit()`` runs it.
"""

from lmforge.train.builder import build_trainer

__all__ = ["build_trainer"]
