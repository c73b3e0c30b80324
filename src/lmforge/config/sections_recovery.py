"""lmforge's own ``recovery:`` section (an extension; absent from the original's YAMLs).

Self-healing training (train/recovery/): on a loss spike, a divergence or more non-finite steps than
the skip policy absorbs, every rank rolls back to the newest safe checkpoint and goes on, stepping
over the global batches in between (``data: skip``) or training on them again (``data: replay``).
"""

from __future__ import annotations

from pydantic import model_validator

from lmforge.config.base import Float, Section, check_one_of

RECOVERY_DATA_MODES = ("skip", "replay")


class RecoveryConfig(Section):
    """Roll back and go on instead of crashing or training on with damaged weights (docs/training.md)."""

    enable: bool = False
    # Rollbacks allowed in one run; one more anomaly stops the run with an error (and a checkpoint).
    max_rollbacks: int = 3
    # skip: the global batches between the restored step and the detection are never trained on;
    # replay: they are trained on again (a transient fault, e.g. a flipped bit, does not recur).
    data: str = "skip"
    # The learning rate is multiplied by lr_scale for lr_scale_steps steps after each rollback.
    lr_scale: Float = 1.0
    lr_scale_steps: int = 0
    # Every snapshot_interval steps each rank keeps a CPU copy of its own state (the two newest are kept):
    # a rollback restores from it, without reading the disk, when it is newer than the safe checkpoint.
    snapshot_interval: int = 0

    @model_validator(mode="after")
    def _check(self) -> RecoveryConfig:
        check_one_of(self.data, "recovery.data", RECOVERY_DATA_MODES)
        if self.max_rollbacks < 1:
            raise ValueError(
                f"recovery.max_rollbacks must be an int >= 1 (rollbacks allowed in one run), got "
                f"{self.max_rollbacks}; to turn recovery off set recovery.enable: false"
            )
        if not 0.0 < self.lr_scale <= 1.0:
            raise ValueError(
                f"recovery.lr_scale must be in (0, 1] (the factor applied to the learning rate after a "
                f"rollback; 1.0 = unchanged), got {self.lr_scale}"
            )
        if self.lr_scale_steps < 0:
            raise ValueError(
                f"recovery.lr_scale_steps must be a non-negative int (steps after a rollback that train at "
                f"lr x recovery.lr_scale), got {self.lr_scale_steps}"
            )
        if self.snapshot_interval < 0:
            raise ValueError(
                f"recovery.snapshot_interval must be a non-negative int (steps between two in-memory snapshots "
                f"of each rank's state; 0: none), got {self.snapshot_interval}"
            )
        if self.lr_scale != 1.0 and self.lr_scale_steps == 0:
            raise ValueError(
                f"recovery.lr_scale is {self.lr_scale} but recovery.lr_scale_steps is 0, so it would never "
                "apply; set recovery.lr_scale_steps to the number of steps after a rollback that train at "
                "the lowered learning rate, or recovery.lr_scale: 1.0"
            )
        return self
