"""Rules of the rows "loss does not decrease" and "loss decreases slower than expected": the learning
rate and its schedule, parameters that never change, weight decay and Adam's eps."""

from __future__ import annotations

from typing import Any

from lmforge.tools.doctor.evidence import RunEvidence
from lmforge.tools.doctor.rule_base import (
    HIGH_WEIGHT_DECAY,
    LARGE_EPS,
    LR_CEILING,
    MIN_STEPS,
    TINY_LR,
    WARMUP_UNREACHED,
    Finding,
    RuleResult,
    _base_lr,
    _eps_key,
    _eps_value,
    _fmt,
    _loss_text,
    _matches,
    _names,
    _opt_type,
    _optimizer,
    _schedule,
    _steps_configured,
    _warmup_steps,
    healthy_lr,
    optimizer_setting,
)


def lr_zero(ev: RunEvidence) -> RuleResult:
    lrs = ev.series("lr")
    if len(lrs) < MIN_STEPS:
        return None
    if any(v != 0 for _, v in lrs):
        return f"the lr is above 0 (peak {_fmt(max(v for _, v in lrs))})"
    base = _base_lr(ev)
    if base and all(r.get("skipped") is True for r in ev.metrics if "lr" in r):
        # Skipped steps do not advance the schedule: a warm-up from 0 stays at 0 when every step is
        # skipped, and the cause is what skipped them (the NaN / Inf rules), not the learning rate.
        return (
            "the lr stayed 0 because every logged step was skipped (no update advanced the schedule from 0)"
        )
    if base == 0 or base is None:
        keys = {"lr_scheduler.learning_rate": 3e-4}
        cause = "lr_scheduler.learning_rate is 0, so no update changes a weight"
    else:
        keys = {"lr_scheduler.warmup_lr_init": 0.0, "lr_scheduler.warmup_steps": max(1, len(lrs) // 20)}
        cause = f"the schedule stays at 0 although lr_scheduler.learning_rate is {_fmt(base)}"
    return Finding(
        symptom="loss does not decrease",
        evidence=f"lr is 0 at all {len(lrs)} logged steps; {_loss_text(ev)}",
        cause=f"learning rate 0: {cause}",
        keys=keys,
    )


def warmup_never_ends(ev: RunEvidence) -> RuleResult:
    sched = _schedule(ev)
    base = _base_lr(ev)
    steps = _steps_configured(ev)
    lrs = ev.series("lr")
    if sched is None or not base or steps is None:
        return None
    warm = int(getattr(sched, "warmup_steps", 0) or 0)
    decay = getattr(sched, "decay_steps", None)
    end = steps if decay is None else min(steps, int(decay))
    peak_seen = max((v for _, v in lrs), default=0.0)
    if warm == 0 or warm < end:
        return f"warm-up ({warm} steps) ends before the decay/training end (step {end})"
    # The spec's troubleshooting case: a warm-up longer than decay_steps leaves the lr at lr_end from step
    # decay_steps on, whatever it reached before; only a warm-up longer than the run itself is harmless
    # once the lr got near its peak.
    ends_early = decay is not None and int(decay) < steps
    if lrs and peak_seen >= WARMUP_UNREACHED * base and not ends_early:
        return None
    lr_sched = ev.section("lr_scheduler")
    target = max(1, round(0.03 * end))
    if lr_sched.get("warmup_ratio") is not None and lr_sched.get("warmup_steps") is None:
        keys: dict[str, Any] = {"lr_scheduler.warmup_ratio": 0.03}
    else:
        keys = {"lr_scheduler.warmup_steps": target}
    where = f"decay_steps {decay}" if ends_early else f"training.steps {steps}"
    at_end = [(s, v) for s, v in lrs if ends_early and s > int(decay)]
    sits = (
        f"; from step {int(decay)} on the lr sits at lr_end ({_fmt(at_end[-1][1])} over {len(at_end)} logged steps)"
        if at_end
        else ""
    )
    return Finding(
        symptom="loss does not decrease (or barely)",
        evidence=(
            f"warm-up lasts {warm} steps, longer than {where}; the lr only reached "
            f"{_fmt(peak_seen)} of lr_scheduler.learning_rate {_fmt(base)}{sits}; {_loss_text(ev)}"
        ),
        cause="warm-up longer than the decay / the run: the lr never leaves the bottom of its ramp",
        keys=keys,
    )


def lr_tiny(ev: RunEvidence) -> RuleResult:
    lrs = ev.series("lr")
    if len(lrs) < MIN_STEPS or _opt_type(ev).lower() not in ("adamw", "adam", "lamb", "muon", "lion"):
        return None
    peak = max(v for _, v in lrs)
    high = LR_CEILING
    if peak > high:
        return None  # far above the usual range: lr_huge names it
    if peak == 0 or peak >= TINY_LR:
        return (
            f"peak lr {_fmt(peak)} is in the usual range ({_fmt(TINY_LR)} .. {_fmt(high)})" if peak else None
        )
    if _warmup_steps(ev) and peak < WARMUP_UNREACHED * (_base_lr(ev) or 0):
        return None  # the warm-up rule explains it
    return Finding(
        symptom="loss decreases much slower than expected",
        evidence=f"the peak lr is {_fmt(peak)}; {_loss_text(ev)}",
        cause=f"learning rate too small for {_opt_type(ev)} (the article's range is 1e-4 .. 3e-4)",
        keys={"lr_scheduler.learning_rate": 3e-4},
    )


def lr_huge(ev: RunEvidence) -> RuleResult:
    """A peak lr far above what any model of this optimizer trains at: it cannot be healthy."""
    lrs = ev.series("lr")
    if len(lrs) < MIN_STEPS or _opt_type(ev).lower() not in ("adamw", "adam", "lamb", "muon", "lion"):
        return None
    peak, high = max(v for _, v in lrs), LR_CEILING
    if peak <= high:
        return None  # lr_tiny reports the healthy range
    return Finding(
        symptom="learning rate far above the usual range",
        evidence=f"the peak lr is {_fmt(peak)}, above {_fmt(high)} (the highest lr {_opt_type(ev)} trains at, "
        f"toy models included); {_loss_text(ev)}",
        cause="learning rate too high: each update overshoots; the loss spikes, diverges or goes NaN",
        keys={"lr_scheduler.learning_rate": healthy_lr(_base_lr(ev) or peak)},
    )


def schedule_ended(ev: RunEvidence) -> RuleResult:
    sched = _schedule(ev)
    steps = _steps_configured(ev)
    if sched is None or steps is None:
        return None
    decay = getattr(sched, "decay_steps", None)
    if decay is None:
        return None
    decay = int(decay)
    if decay >= 0.75 * steps:
        return f"the lr schedule decays until step {decay} of {steps}"
    if (
        "decay_steps" not in ev.section("lr_scheduler")
        or int(getattr(sched, "warmup_steps", 0) or 0) >= decay
    ):
        return None  # not set by the user, or the warm-up rule explains it
    return Finding(
        symptom="loss stops improving part-way through the run",
        evidence=f"lr_scheduler.decay_steps {decay} is {100 * decay / steps:.0f}% of training.steps {steps}: "
        f"the lr sits at lr_end for the last {steps - decay} steps",
        cause="the schedule ended early: the rest of the run trains at the minimum lr",
        keys={"lr_scheduler.decay_steps": steps},
    )


def parameters_not_updated(ev: RunEvidence) -> RuleResult:
    facts = ev.facts
    if "not_updated" not in facts and "frozen" not in facts:
        return None
    # LoRA freezes the base model on purpose (lora_config): only the adapters must change.
    intended = set(facts.get("frozen", [])) if ev.config.get("lora_config") else set()
    stuck = [
        n
        for n in dict.fromkeys(
            [*facts.get("frozen", []), *facts.get("not_in_optimizer", []), *facts.get("not_updated", [])]
        )
        if n not in intended
    ]
    checked_at = facts.get("not_updated_checked_at_step")
    if not stuck:
        return (
            f"every parameter changed by step {checked_at}"
            if checked_at
            else "no parameter is frozen or left out of the optimizer"
        )
    frozen = [n for n in facts.get("frozen", []) if n not in intended]
    outside = facts.get("not_in_optimizer", [])
    parts = []
    if frozen:
        parts.append(f"requires_grad=False: {_names(frozen)}")
    if outside:
        parts.append(f"in no optimizer group: {_names(outside)}")
    rest = [n for n in facts.get("not_updated", []) if n not in frozen and n not in outside]
    if rest:
        parts.append(f"unchanged after {checked_at} steps: {_names(rest)}")
    keys: dict[str, Any] = {}
    for rule, scale in (
        (_optimizer(ev).get("lr_scale") or {}).items()
        if isinstance(_optimizer(ev).get("lr_scale"), dict)
        else []
    ):
        if isinstance(scale, (int, float)) and scale < 1e-2 and any(_matches(rule, n) for n in stuck):
            keys[f"optimizer.lr_scale.{rule}"] = 1.0
    experts = [n for n in rest if ".experts." in n]
    cause = "frozen or unrouted parameters: part of the model never trains " + (
        "(experts that receive no tokens: see the routing findings)"
        if experts and len(experts) == len(rest) and not frozen and not outside
        else "(frozen with requires_grad=False in code, left out of the optimizer, or given an lr multiplier of ~0)"
    )
    return Finding(
        symptom="loss does not decrease / decreases slowly",
        evidence=f"{len(stuck)} parameter(s) never change: " + "; ".join(parts),
        cause=cause,
        keys=keys,
    )


def decay_on_everything(ev: RunEvidence) -> RuleResult:
    if "decayed_1d" not in ev.facts:
        return None
    names = ev.facts["decayed_1d"]
    if not names:
        return "norm weights and biases are excluded from weight decay"
    return Finding(
        symptom="loss decreases slower than expected",
        evidence=f"{len(names)} norm/bias parameter(s) get weight decay: {_names(names)}",
        cause="weight decay on everything: norms and biases are decayed (the article: exclude 1-D parameters)",
        keys={"optimizer.weight_decay_exclude": ["*norm*", "*bias*"]},
    )


def weight_decay_too_high(ev: RunEvidence) -> RuleResult:
    wd = optimizer_setting(ev, "weight_decay")
    if not isinstance(wd, (int, float)) or isinstance(wd, bool):
        return None
    if wd <= HIGH_WEIGHT_DECAY:
        return f"optimizer.weight_decay {_fmt(wd)} is in the usual range (<= {HIGH_WEIGHT_DECAY})"
    return Finding(
        symptom="loss decreases slower than expected",
        evidence=f"optimizer.weight_decay is {_fmt(wd)}; {_loss_text(ev)}",
        cause="weight decay too high: each step shrinks the weights by lr x weight_decay, undoing what they learn",
        keys={"optimizer.weight_decay": 0.1},
    )


def eps_too_large(ev: RunEvidence) -> RuleResult:
    eps = _eps_value(ev)
    if eps is None or not ev.config:
        return None
    if eps <= LARGE_EPS:
        return None
    return Finding(
        symptom="loss decreases slower than expected",
        evidence=f"{_eps_key(ev)} is {_fmt(eps)}; {_loss_text(ev)}",
        cause="Adam eps too large: it dominates sqrt(v) and shrinks every update",
        keys={_eps_key(ev): 1e-8},
    )
