"""What the steps of a run did: how many applied their update, how many were skipped and why.

The end-of-run summary reports it (the skipped steps of this run, and the ones in a row at its end), and a
run whose every step was skipped ends with :func:`no_update_failure`'s error instead of "completed"
(exit status 5, docs/training.md "Exit statuses"): its weights are the ones it started from.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# The kind of a skip, from the start of its reason (train/step.py `_skip_reason`, `_skip_or_scale`).
NON_FINITE_LOSS = "non-finite loss"
NON_FINITE_NORM = "non-finite gradient norm"
NORM_THRESHOLD = "gradient norm above monitor.health_checkpoint.global_norm_skip_threshold"
EMBEDDING_THRESHOLD = "embedding gradient norm above monitor.health_checkpoint.embedding_local_norm_threshold"
FP16_OVERFLOW = "float16 gradient overflow"
_KINDS = (
    ("loss is ", NON_FINITE_LOSS),
    ("gradient norm is ", NON_FINITE_NORM),
    ("gradient norm ", NORM_THRESHOLD),
    ("embedding gradient norm ", EMBEDDING_THRESHOLD),
    ("float16 gradient overflow", FP16_OVERFLOW),
)


def skip_kind(reason: str | None) -> str:
    for prefix, kind in _KINDS:
        if (reason or "").startswith(prefix):
            return kind
    return reason or "unknown"


@dataclass
class StepTally:
    """The steps this launch of the run took (a resumed run counts from its resume; a step replayed after a
    rollback counts again)."""

    taken: int = 0
    applied: int = 0
    first_step: int | None = None
    last_step: int | None = None
    kinds: Counter[str] = field(default_factory=Counter)  # skipped steps by kind
    trailing: int = 0  # skipped steps in a row at the end
    last_reason: str | None = None  # the newest skip's reason
    last_applied: int | None = None  # the step of the newest applied update

    def record(self, step: int, result: Any) -> None:
        self.taken += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if result.skipped:
            self.kinds[skip_kind(result.skip_reason)] += 1
            self.trailing += 1
            self.last_reason = result.skip_reason
            return
        self.applied += 1
        self.trailing = 0
        self.last_applied = step

    @property
    def skipped(self) -> int:
        return self.taken - self.applied

    @property
    def none_applied(self) -> bool:
        """Steps were taken and not one applied its update."""
        return self.taken > 0 and self.applied == 0

    def breakdown(self) -> str:
        """``"3 non-finite loss, 1 float16 gradient overflow"``."""
        return ", ".join(f"{n} {kind}" for kind, n in self.kinds.most_common())

    def summary_line(self) -> str:
        """The summary's "skipped steps (this run)" value."""
        if not self.skipped:
            return f"0 of {self.taken}"
        return f"{self.skipped} of {self.taken} ({self.breakdown()})"

    def trailing_line(self) -> str | None:
        """The summary's "last steps skipped" value, when the run applied updates and ended on skips."""
        if not self.trailing or self.none_applied:
            return None
        first = (self.last_step or 0) - self.trailing + 1
        return (
            f"{self.trailing} (steps {first}..{self.last_step}; last: {self.last_reason}): the final weights are "
            f"those after the update of step {self.last_applied}"
        )


def no_update_failure(tally: StepTally, policy: Any, *, saved: list[str]) -> str | None:
    """The error of a run none of whose steps applied its update (None when one did, or none was taken).

    ``policy`` is the run's :class:`~lmforge.train.step.SkipPolicy`; ``saved`` the checkpoints this run
    wrote (they hold the starting weights under later step numbers)."""
    if not tally.none_applied:
        return None
    steps = f"step {tally.first_step}" if tally.taken == 1 else f"steps {tally.first_step}..{tally.last_step}"
    kept = (
        f"; the checkpoints it saved ({', '.join(saved)}) hold those same weights under later step numbers: "
        "delete them before resuming from checkpoint.save_path"
        if saved
        else ""
    )
    return (
        f"Training applied no update: all {tally.taken} step(s) this run took ({steps}) were skipped "
        f"({tally.breakdown()}; the last: {tally.last_reason}), so the model's weights are the ones it started "
        f"from{kept}. {_why_not_stopped(tally, policy)}{_what_to_change(tally, policy)}"
    )


def _why_not_stopped(tally: StepTally, policy: Any) -> str:
    limit = int(policy.max_consecutive)
    if limit == 0:
        return (
            "The run did not stop at the first of them because monitor.health_checkpoint.global_norm_skip_time "
            "is 0 (never stop on skipped steps). "
        )
    if set(tally.kinds) == {FP16_OVERFLOW}:
        return (
            "float16 overflows count towards monitor.health_checkpoint.global_norm_skip_time only once the loss "
            "scale is below 1. "
        )
    if tally.taken < limit:
        source = "" if policy.spike_skipping else ", its default without a monitor.health_checkpoint section"
        return (
            f"The run took fewer steps than the {limit} skipped steps in a row that stop a run "
            f"(monitor.health_checkpoint.global_norm_skip_time = {limit}{source}). "
        )
    return ""


def _what_to_change(tally: StepTally, policy: Any) -> str:
    advice = []
    if tally.kinds[NON_FINITE_LOSS] or tally.kinds[NON_FINITE_NORM]:
        advice.append(
            "lower lr_scheduler.learning_rate and check the data and the weights the run starts from (a loss "
            "that is not finite from the first step points at damaged weights: checkpoint.load_path, "
            "model.from_pretrained, or a model setting)"
        )
    if tally.kinds[NORM_THRESHOLD]:
        advice.append(
            f"raise monitor.health_checkpoint.global_norm_skip_threshold ({policy.grad_norm_threshold:g}), "
            "or omit the monitor.health_checkpoint section (spike skipping is opt-in)"
        )
    if tally.kinds[EMBEDDING_THRESHOLD]:
        advice.append(
            "raise monitor.health_checkpoint.embedding_local_norm_threshold "
            f"({policy.embedding_norm_threshold:g}), or omit the monitor.health_checkpoint section"
        )
    if tally.kinds[FP16_OVERFLOW]:
        advice.append(
            "with float16 compute the loss scale starts at 65536 and halves at each overflow: train more steps, "
            "or use model.compute_dtype: bfloat16"
        )
    text = "; ".join(advice) or "check the data and the model settings"
    return text[0].upper() + text[1:] + "."
