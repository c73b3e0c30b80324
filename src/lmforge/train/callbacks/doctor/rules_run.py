"""Rules about the run as a whole: whether it trained at all, what it trained on, what recovery repaired,
and the fallback "loss does not decrease" when no other rule named a cause."""

from __future__ import annotations

from lmforge.train.callbacks.doctor.evidence import RunEvidence
from lmforge.train.callbacks.doctor.rule_base import (
    FLAT_LOSS_REL,
    Finding,
    RuleResult,
    _fmt,
    _loss_text,
    _loss_trend,
)


def loss_flat(ev: RunEvidence) -> RuleResult:
    """The symptom alone, when no rule above named a cause."""
    trend = _loss_trend(ev)
    if trend is None:
        return None
    first, last, n = trend
    if last < first * (1 - FLAT_LOSS_REL):
        return f"loss fell from {_fmt(first)} to {_fmt(last)} over {n} steps"
    return Finding(
        symptom="loss does not decrease",
        evidence=_loss_text(ev),
        cause="no cause found in the lr, the schedule or the parameters: check the data (labels, loss_mask) and "
        "the gradient norm (a norm near 1e-8 is vanishing gradients)",
        keys={},
    )
