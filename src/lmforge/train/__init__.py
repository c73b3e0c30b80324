"""The trainer: the loop, checkpoints and exact resume, callbacks, monitoring and evaluation.

``build_trainer(cfg, output_dir=None, device=None)`` builds everything a run needs from a
``TrainConfig`` (one process or under torchrun); ``trainer.fit()`` runs it.
"""

from lmforge.train.builder import build_trainer

__all__ = ["build_trainer"]
