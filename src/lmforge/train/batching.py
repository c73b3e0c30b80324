"""Global batch size per step: static, or growing during ``training.rampup_batch_size`` ramp-up."""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.errors import ConfigError


@dataclass(frozen=True)
class BatchSchedule:
    """How many samples (and micro-batches per data-parallel rank) each step consumes.

    Ramp-up ``[start, increment, rampup_samples]`` follows the original: the global batch after
    ``consumed`` samples is ``min(start + floor(consumed / (rampup_samples / n)) * increment, gbs)``
    with ``n = (gbs - start) // increment`` increments; past ``rampup_samples`` it is ``gbs``.
    """

    global_batch_size: int
    local_batch_size: int
    data_parallel: int
    rampup: tuple[int, int, int] | None = None

    @property
    def samples_per_micro_step(self) -> int:
        return self.local_batch_size * self.data_parallel

    def global_batch_at(self, consumed_samples: int) -> int:
        """The configured global batch size of the step that starts after ``consumed_samples``."""
        if self.rampup is None:
            return self.global_batch_size
        start, inc, rampup_samples = self.rampup
        increments = (self.global_batch_size - start) // inc
        if increments <= 0 or rampup_samples == 0 or consumed_samples >= rampup_samples:
            return self.global_batch_size
        samples_per_increment = rampup_samples / increments
        return min(start + int(consumed_samples // samples_per_increment) * inc, self.global_batch_size)

    def accumulation_steps_at(self, consumed_samples: int) -> int:
        return max(self.global_batch_at(consumed_samples) // self.samples_per_micro_step, 1)

    def samples_of_step_at(self, consumed_samples: int) -> int:
        """Samples the step actually consumes: accumulation steps x dp x local batch.

        The original advances consumed_samples by the configured batch even when floor division
        trains on fewer samples; lmforge counts what was trained on, so resuming lands on the next
        unseen sample.
        """
        return self.accumulation_steps_at(consumed_samples) * self.samples_per_micro_step

    def validate(self) -> None:
        per_step = self.samples_per_micro_step
        if self.rampup is None:
            if per_step > self.global_batch_size:
                raise ConfigError(
                    "training.global_batch_size: The product of data_parallel and local_batch_size exceeds "
                    "global_batch_size, please increase global_batch_size or decrease local_batch_size "
                    f"(data_parallel {self.data_parallel} x local_batch_size {self.local_batch_size} = "
                    f"{per_step} > global_batch_size {self.global_batch_size})."
                )
            return
        start, inc, _ = self.rampup
        for gbs in range(start, self.global_batch_size + 1, inc):
            if gbs % per_step != 0:
                raise ConfigError(
                    f"training.rampup_batch_size: the global batch size {gbs} during ramp-up is not a "
                    f"multiple of data_parallel x local_batch_size = {per_step}."
                )
