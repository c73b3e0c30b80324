"""Rules about the run as a whole: whether it trained at all, what it trained on, what recovery repaired,
and the fallback "loss does not decrease" when no other rule named a cause."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lmforge.tools.doctor.evidence import RunEvidence
from lmforge.tools.doctor.rule_base import (
    FLAT_LOSS_REL,
    Finding,
    RuleResult,
    _fmt,
    _loss_text,
    _loss_trend,
    _steps_configured,
    _warmup_steps,
)

MAX_EPOCHS = 4.0  # more passes over the training set than this: the model memorises it
_ERROR_LINE = re.compile(r"(Error|Exception|Traceback|Killed|out of memory)", re.I)


def no_steps(ev: RunEvidence) -> RuleResult:
    """A run without one step record did not train: never "healthy"."""
    if ev.metrics:
        return None
    errors = [ln.strip() for ln in ev.log_lines if _ERROR_LINE.search(ln)]
    said = (
        f"; train.log: {errors[-1][:300]}" if errors else "; train.log holds no error (killed from outside?)"
    )
    return Finding(
        symptom="the run never completed a step",
        evidence=f"metrics.jsonl holds no step record{said}",
        cause="it died before its first step (a configuration, data or memory error at start-up, or it was "
        "killed): nothing was trained, so no other rule can judge it",
        keys={},
        fatal=True,
    )


def _paths(value: Any) -> set[str]:
    items = value if isinstance(value, list) else [value]
    return {
        str(x).strip() for x in items if isinstance(x, str) and not re.fullmatch(r"\s*[-+]?[\d.eE]+\s*", x)
    }


def _data_paths(section: Any, keys: tuple[str, ...]) -> set[str]:
    loader = section.get("dataloader") if isinstance(section, Mapping) else None
    if not isinstance(loader, Mapping):
        return set()
    inner = loader.get("config") if isinstance(loader.get("config"), Mapping) else {}
    out: set[str] = set()
    for key in keys:
        out |= _paths(inner.get(key)) | _paths(loader.get(key))
    return out


def repeated_data(ev: RunEvidence) -> RuleResult:
    """Several epochs of a small training set, or validation data that is training data."""
    train = ev.section("train_dataset")
    train_paths = _data_paths(train, ("data_path", "train_data_path"))
    valid_paths = _data_paths(train, ("valid_data_path",))
    evaluation = ev.section("eval_dataset")
    if evaluation:
        same_split = (evaluation.get("dataloader") or {}).get("config", {}).get("split") == (
            (train.get("dataloader") or {}).get("config", {}).get("split")
        )
        # The same files with the same split give disjoint train/valid parts; other splits may overlap.
        valid_paths |= _data_paths(evaluation, ("valid_data_path",))
        if not same_split:
            valid_paths |= _data_paths(evaluation, ("data_path", "train_data_path"))
    shared = sorted(train_paths & valid_paths)
    if shared:
        return Finding(
            symptom="validation data is training data",
            evidence=f"the validation split reads {', '.join(shared[:3])}, which the training split reads too",
            cause="the validation loss measures memorisation, not generalisation: it falls with the training loss",
            keys={},
        )
    per_epoch = ev.facts.get("train_samples_per_epoch")
    consumed = max(
        (int(r["consumed_samples"]) for r in ev.metrics if isinstance(r.get("consumed_samples"), int)),
        default=0,
    )
    if not isinstance(per_epoch, int) or per_epoch <= 0 or not consumed:
        return None
    epochs = consumed / per_epoch
    if epochs <= MAX_EPOCHS:
        return f"{epochs:.2g} epoch(s) of a {per_epoch}-sample training set"
    steps = _steps_configured(ev)
    return Finding(
        symptom="training on repeated data",
        evidence=f"{consumed} samples consumed from a training set of {per_epoch} samples: {epochs:.1f} epochs",
        cause=f"the model sees the same samples again and again (more than {MAX_EPOCHS:g} epochs): it memorises "
        "them, the training loss keeps falling and tells nothing about new text; use more data",
        keys={"training.steps": max(1, int(steps * MAX_EPOCHS / epochs))} if steps else {},
    )


def rollbacks(ev: RunEvidence) -> RuleResult:
    """What recovery (the ``recovery:`` section) repaired: each rollback, where and why."""
    if not ev.rollbacks:
        return "no rollback (recovery)" if ev.section("recovery").get("enable") else None
    parts = []
    for e in ev.rollbacks[:5]:
        samples = e.get("skipped_samples") or e.get("replayed_samples")
        what = "skipped" if e.get("skipped_samples") else "replayed"
        data = (
            f"; samples {samples[0]}..{samples[1]} {what}"
            if isinstance(samples, list) and len(samples) == 2
            else ""
        )
        parts.append(f"step {e.get('step')} -> {e.get('to_step')} ({e.get('reason')}{data})")
    replayed = [e for e in ev.rollbacks if e.get("data") == "replay"]
    keys: dict[str, Any] = {}
    if len(replayed) >= 2 and len({e.get("to_step") for e in replayed}) < len(replayed):
        keys["recovery.data"] = "skip"  # the same data caused it again: step over it
    return Finding(
        symptom=f"training rolled back {len(ev.rollbacks)} time(s)",
        evidence="; ".join(parts) + (f" and {len(ev.rollbacks) - 5} more" if len(ev.rollbacks) > 5 else ""),
        cause="recovery detected a loss spike, a divergence or repeated non-finite steps and restored the newest "
        "safe checkpoint; one rollback is a repaired fault, repeated ones at the same samples point to bad data, "
        "at different places to an lr too high for this model",
        keys=keys,
    )


def loss_flat(ev: RunEvidence) -> RuleResult:
    """The symptom alone, when no rule above named a cause."""
    trend = _loss_trend(ev)
    if trend is None:
        return None
    first, last, n = trend
    if last < first * (1 - FLAT_LOSS_REL):
        return f"loss fell from {_fmt(first)} to {_fmt(last)} over {n} steps"
    warm, last_step = _warmup_steps(ev) or 0, max(s for s, _ in ev.series("loss"))
    if last_step <= warm:
        # Still warming up at a fraction of the peak lr: a flat loss is expected, not a symptom.
        return f"the run is still in its warm-up (step {last_step} of {warm}): a flat loss is expected there"
    return Finding(
        symptom="loss does not decrease",
        evidence=_loss_text(ev),
        cause="no cause found in the lr, the schedule or the parameters: check the data (labels, loss_mask) and "
        "the gradient norm (a norm near 1e-8 is vanishing gradients)",
        keys={},
    )
