"""What ``recovery.enable: true`` needs from the rest of the file, checked before anything is built."""

from __future__ import annotations

from lmforge.config import TrainConfig
from lmforge.errors import ConfigError


def check_recovery(cfg: TrainConfig) -> None:
    """A rollback restores a checkpoint that this run wrote, with its optimizer state."""
    recovery = cfg.recovery
    if not recovery.enable:
        return
    ck = cfg.checkpoint
    if not ck.enable_save or not ck.save_path:
        raise ConfigError(
            "recovery.enable: true rolls back to a checkpoint of this run, but checkpoint.enable_save is false "
            "or checkpoint.save_path is empty; set checkpoint.enable_save: true with a save_path (and a "
            "save_interleaved_steps that leaves a checkpoint to return to), or recovery.enable: false."
        )
    if ck.no_save_optim:
        raise ConfigError(
            "recovery.enable: true restores the optimizer state with the weights, but checkpoint.no_save_optim "
            "is true, so checkpoints hold none; set checkpoint.no_save_optim: false or recovery.enable: false."
        )
