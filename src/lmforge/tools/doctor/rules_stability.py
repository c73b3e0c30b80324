"""Rules of the rows "oscillation and spikes" and "NaN / Inf": loss spikes and divergence, clipping,
grad-norm spikes, growing attention logits, fp16 without loss scaling, eps in 16-bit compute."""

from __future__ import annotations

import math
from statistics import median
from typing import Any

from lmforge.tools.doctor.evidence import RunEvidence
from lmforge.tools.doctor.rule_base import (
    CLIP_MEDIAN,
    CLIP_MIN_STEPS,
    CLIP_SHARE,
    GRAD_SPIKE_FACTOR,
    LOSS_RISE,
    MAX_LOGIT_LIMIT,
    MIN_STEPS,
    SMALL_EPS_16BIT,
    SPIKE_FACTOR,
    Finding,
    RuleResult,
    _after_warmup,
    _base_lr,
    _compute_dtype,
    _eps_key,
    _eps_value,
    _fmt,
    _loss_scaling_on,
    _max_norm,
    _nonfinite_steps,
    _opt_type,
    _steps_configured,
    _warmup_steps,
    healthy_lr,
)


def eps_too_small(ev: RunEvidence) -> RuleResult:
    eps = _eps_value(ev)
    dtype = _compute_dtype(ev)
    if eps is None or not ev.config:
        return None
    if dtype not in ("bfloat16", "float16") or eps >= SMALL_EPS_16BIT:
        return f"{_eps_key(ev)} {_fmt(eps)} suits {dtype} compute"
    nonfinite = _nonfinite_steps(ev)
    seen = f"; non-finite loss/grad norm at steps {nonfinite[:5]}" if nonfinite else "; no NaN yet"
    return Finding(
        symptom="NaN / Inf risk (eps too small for mixed precision)",
        evidence=f"{_eps_key(ev)} is {_fmt(eps)} with model.compute_dtype {dtype}{seen}",
        cause=f"eps too small for {dtype}: where sqrt(v) is tiny (rare tokens, dead units, a gradient underflowed "
        "in 16-bit compute) m / (sqrt(v) + eps) becomes a full-lr step of noise (the article: not below 1e-6 in "
        "mixed precision)",
        keys={_eps_key(ev): 1e-6},
    )


def fp16_without_scaling(ev: RunEvidence) -> RuleResult:
    if not ev.config:
        return None
    dtype = _compute_dtype(ev)
    if dtype != "float16":
        return f"model.compute_dtype is {dtype} (no fp16 underflow)"
    scales = [v for _, v in ev.series("loss_scale")]
    if scales:
        return f"fp16 compute with dynamic loss scaling (scale {_fmt(scales[-1])} at the last step)"
    if _loss_scaling_on(ev.config):
        return "fp16 compute with loss scaling"
    nonfinite = _nonfinite_steps(ev)
    zero = [s for s, v in ev.series("grad_norm") if v == 0]
    seen = []
    if nonfinite:
        seen.append(f"non-finite loss/grad norm at steps {nonfinite[:5]}")
    if zero:
        seen.append(f"zero grad norm at steps {zero[:5]}")
    return Finding(
        symptom="NaN / Inf or silently vanishing gradients (fp16)",
        evidence="model.compute_dtype is float16 and no step reports a loss scale (metrics loss_scale); "
        f"{', '.join(seen) or 'no NaN yet'}",
        cause="fp16 without loss scaling: small gradients underflow to 0 and large activations overflow to Inf",
        keys={"model.compute_dtype": "bfloat16"},
    )


def nonfinite_values(ev: RunEvidence) -> RuleResult:
    bad = _nonfinite_steps(ev)
    if not ev.metrics:
        return None
    if not bad:
        return "loss and grad norm are finite at every step"
    dtype = _compute_dtype(ev) if ev.config else "?"
    eps = _eps_value(ev)
    if ev.config and dtype == "float16" and not _loss_scaling_on(ev.config):
        return None  # fp16_without_scaling names it
    if eps is not None and dtype in ("bfloat16", "float16") and eps < SMALL_EPS_16BIT:
        return None  # eps_too_small names it
    base = _base_lr(ev)
    keys: dict[str, Any] = {"lr_scheduler.learning_rate": healthy_lr(base)} if base else {}
    if _max_norm(ev) is None and ev.config:
        keys["training.max_norm"] = 1.0
    return Finding(
        symptom="NaN / Inf in the loss or gradients",
        evidence=f"non-finite loss or grad norm at {len(bad)} step(s), first at step {bad[0]}",
        cause="overflowing logits or updates: the lr is too high for this model (or the data holds a bad batch)",
        keys=keys,
    )


def loss_diverges_or_spikes(ev: RunEvidence) -> RuleResult:
    losses = [(s, v) for s, v in ev.series("loss") if math.isfinite(v)]
    if len(losses) < MIN_STEPS + 2:
        return None
    start = losses[0][1]
    warm = _warmup_steps(ev) or 0
    spikes = []
    for i in range(3, len(losses)):
        before = median(v for _, v in losses[max(0, i - 10) : i])
        if losses[i][1] > SPIKE_FACTOR * before:
            spikes.append(losses[i][0])
    peak_step, peak = max(losses[1:], key=lambda sv: sv[1])
    rose = peak > LOSS_RISE * start
    if not rose and len(spikes) < 2:
        return f"no loss spike (no step above {SPIKE_FACTOR}x the median of the 10 before it)"
    base = _base_lr(ev)
    keys: dict[str, Any] = {}
    if base:
        keys["lr_scheduler.learning_rate"] = healthy_lr(base)
    if warm < max(1, (_steps_configured(ev) or len(losses)) // 100):
        keys["lr_scheduler.warmup_steps"] = max(1, round(0.03 * (_steps_configured(ev) or len(losses))))
    evidence = []
    if rose:
        evidence.append(f"loss rose from {_fmt(start)} to {_fmt(peak)} at step {peak_step}")
    if spikes:
        evidence.append(f"spikes (> {SPIKE_FACTOR}x the recent median) at steps {spikes[:8]}")
    peak_lr = max((v for _, v in ev.series("lr")), default=None)
    if peak_lr is not None:
        evidence.append(f"peak lr {_fmt(peak_lr)}")
    return Finding(
        symptom="loss oscillates / spikes / diverges",
        evidence="; ".join(evidence),
        cause="learning rate too high (or warm-up too short): steps overshoot",
        keys=keys,
    )


def clipping_most_steps(ev: RunEvidence) -> RuleResult:
    max_norm = _max_norm(ev)
    norms = [v for _, v in _after_warmup(ev, "grad_norm") if math.isfinite(v)]
    if max_norm is None or len(norms) < CLIP_MIN_STEPS:
        return None  # the first steps of every run have large gradients; judge a settled run
    norms = norms[len(norms) // 2 :]  # the recent half
    clipped = sum(1 for v in norms if v > max_norm)
    share = clipped / len(norms)
    med = median(norms)
    if share <= CLIP_SHARE or med <= CLIP_MEDIAN * max_norm:
        return f"gradient clipping acts on {100 * share:.0f}% of recent steps (median grad norm {_fmt(med)})"
    base = _base_lr(ev)
    return Finding(
        symptom="loss oscillates; clipping active on most steps",
        evidence=f"grad norm above training.max_norm {_fmt(max_norm)} on {clipped}/{len(norms)} recent steps, "
        f"median {_fmt(med)}",
        cause="learning rate too high: updates keep the gradients large, so clipping rescales almost every step",
        keys={"lr_scheduler.learning_rate": healthy_lr(base)} if base else {},
    )


def grad_norm_spikes(ev: RunEvidence) -> RuleResult:
    norms = [(s, v) for s, v in ev.series("grad_norm") if math.isfinite(v)]
    if len(norms) < MIN_STEPS + 2:
        return None
    spikes = []
    for i in range(3, len(norms)):
        before = median(v for _, v in norms[max(0, i - 10) : i])
        if before > 0 and norms[i][1] > GRAD_SPIKE_FACTOR * before:
            spikes.append((norms[i][0], norms[i][1], before))
    # One clipped spike that leaves the loss alone is normal (a hard batch); repeated spikes, or one that
    # the loss follows, are the article's oscillation row.
    losses = dict(ev.series("loss"))
    harmful = []
    for s, _, _ in spikes:
        before = [losses[t] for t in range(s - 10, s) if t in losses and math.isfinite(losses[t])]
        after = [losses[t] for t in range(s, s + 3) if t in losses and math.isfinite(losses[t])]
        if before and after and max(after) > LOSS_RISE * median(before):
            harmful.append(s)
    if len(spikes) < 2 and not harmful:
        if spikes:
            return f"one isolated grad-norm spike (step {spikes[0][0]}) that the loss did not follow"
        return f"no grad-norm spike (none above {GRAD_SPIKE_FACTOR:g}x the median of the 10 steps before)"
    keys: dict[str, Any] = {}
    if _max_norm(ev) is None and ev.config:
        keys["training.max_norm"] = 1.0
    base = _base_lr(ev)
    if base:
        keys["lr_scheduler.learning_rate"] = healthy_lr(base, 0.5)
    s, v, before = spikes[0]
    return Finding(
        symptom="grad-norm spikes",
        evidence=f"{len(spikes)} step(s) with grad norm > {GRAD_SPIKE_FACTOR:g}x the recent median, first at step {s} "
        f"({_fmt(v)} vs {_fmt(before)})",
        cause="unstable updates: lr too high for some layers (or a bad batch); clipping is the last line of defence",
        keys=keys,
    )


def max_logits_growing(ev: RunEvidence) -> RuleResult:
    logits = [(s, v) for s, v in ev.series("max_attention_logit") if math.isfinite(v)]
    if len(logits) < MIN_STEPS:
        return None
    first, last = logits[0][1], logits[-1][1]
    if last <= MAX_LOGIT_LIMIT or last <= 2 * first:
        return f"max attention logit {_fmt(last)} (limit {MAX_LOGIT_LIMIT:g}, started at {_fmt(first)})"
    if _opt_type(ev).lower() == "muon":
        keys: dict[str, Any] = {
            "optimizer.qk_clip_enabled": True,
            "optimizer.qk_clip_threshold": MAX_LOGIT_LIMIT,
        }
    else:
        keys = {"optimizer.type": "Muon", "optimizer.qk_clip_threshold": MAX_LOGIT_LIMIT}
    return Finding(
        symptom="max attention logits keep growing (precedes loss spikes)",
        evidence=f"max attention logit {_fmt(first)} at step {logits[0][0]} -> {_fmt(last)} at step {logits[-1][0]}",
        cause="query/key weights grow without bound; QK-Clip rescales them when a head's logit passes the threshold",
        keys=keys,
    )
