"""The doctor's rules: one table, each row a symptom of the article's troubleshooting table (§5.5)
or of the issue, with the evidence it needs, the cause it names and the YAML keys it suggests.

A rule is a function ``RunEvidence -> Finding | None | str``: a :class:`Finding` when it sees the
problem, a string (the healthy sign it checked, e.g. "loss fell from 4.19 to 2.06") when it looked
and found nothing, ``None`` when the run holds no evidence for it. Thresholds are chosen so that
healthy runs (the demo, the recipes, the test runs) raise nothing; they are named constants below.
docs/guide.md ("The training doctor") mirrors :data:`RULES`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from lmforge.train.callbacks.doctor.evidence import RunEvidence

# --- thresholds -----------------------------------------------------------------------------------
MIN_STEPS = 3  # fewer metrics records than this: the curve rules do not judge
FLAT_LOSS_REL = 0.01  # "loss does not decrease": the last window is within 1% of the first
TINY_LR = 1e-6  # a peak lr below this is "tiny" for Adam-type optimizers
WARMUP_UNREACHED = 0.5  # the run never got above half of lr_scheduler.learning_rate
HIGH_WEIGHT_DECAY = 0.3  # decoupled weight decay above this shrinks weights faster than they learn
LARGE_EPS = 1e-4  # Adam eps above this damps every update (the article: 1e-8 .. 1e-6)
SMALL_EPS_16BIT = 1e-10  # eps below this with bf16/fp16 compute: the article's NaN row ("not below 1e-6")
LOSS_RISE = 1.25  # loss above 1.25x its starting value after warm-up: divergence / oscillation
SPIKE_FACTOR = 1.5  # a step whose loss exceeds 1.5x the median of the 10 before it is a spike
GRAD_SPIKE_FACTOR = 10.0  # grad norm above 10x the median of the 10 before it
CLIP_SHARE = 0.8  # clipping on more than 80% of steps ...
CLIP_MEDIAN = 3.0  # ... with a median grad norm above 3x training.max_norm ...
CLIP_MIN_STEPS = 20  # ... over the recent half of at least 20 steps after warm-up
MAX_LOGIT_LIMIT = 100.0  # attention logits above this and still growing: QK-Clip territory
COLLAPSE_SHARE = 0.8  # one expert takes 80% of a layer's routed tokens: routing collapse
IMBALANCE_RATIO = 4.0  # the busiest expert gets 4x the mean load: imbalance
RANK_LOSS_REL = 0.25  # a rank's mean local loss 25% away from the median of the ranks


@dataclass
class Finding:
    symptom: str
    evidence: str
    cause: str
    keys: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "symptom": self.symptom,
            "evidence": self.evidence,
            "cause": self.cause,
            "keys": dict(self.keys),
        }


@dataclass
class Diagnosis:
    findings: list[Finding]
    checked: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [f.to_dict() for f in self.findings], "checked": list(self.checked)}


RuleResult = Finding | str | None


@dataclass(frozen=True)
class Rule:
    name: str
    row: str  # the symptom row it belongs to (the article's table, or the list)
    looks_at: str
    check: Callable[[RunEvidence], RuleResult]


# --- helpers ----------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _window(values: list[float]) -> int:
    return max(1, min(10, len(values) // 5))


def _loss_trend(ev: RunEvidence) -> tuple[float, float, int] | None:
    """(mean of the first window, mean of the last window, steps) over finite losses."""
    losses = [v for _, v in ev.series("loss") if math.isfinite(v)]
    if len(losses) < MIN_STEPS:
        return None
    w = _window(losses)
    return sum(losses[:w]) / w, sum(losses[-w:]) / w, len(losses)


def _loss_text(ev: RunEvidence) -> str:
    trend = _loss_trend(ev)
    if trend is None:
        return ""
    first, last, n = trend
    return f"loss {_fmt(first)} (first steps) -> {_fmt(last)} (last steps) over {n} steps"


def _optimizer(ev: RunEvidence) -> dict[str, Any]:
    return ev.section("optimizer")


def _opt_type(ev: RunEvidence) -> str:
    return str(_optimizer(ev).get("type") or ev.facts.get("optimizer_type") or "AdamW")


def _eps_key(ev: RunEvidence) -> str | None:
    """The YAML key of the Adam eps of this optimizer (Muon's Adam part has its own)."""
    t = _opt_type(ev).lower()
    if t == "muon":
        return "optimizer.adamw_eps"
    if t in ("adamw", "lamb", "adam"):
        return "optimizer.eps"
    return None


def _eps_value(ev: RunEvidence) -> float | None:
    key = _eps_key(ev)
    if key is None:
        return None
    opt = _optimizer(ev)
    name = key.split(".", 1)[1]
    if name in opt and isinstance(opt[name], (int, float)):
        return float(opt[name])
    defaults = {
        "optimizer.eps": 1e-8 if _opt_type(ev).lower() != "lamb" else 1e-6,
        "optimizer.adamw_eps": 1e-8,
    }
    return defaults[key]


def _compute_dtype(ev: RunEvidence) -> str:
    value = ev.section("model").get("compute_dtype") or ev.facts.get("compute_dtype") or "bfloat16"
    value = str(value).lower().replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(value, value)


def _base_lr(ev: RunEvidence) -> float | None:
    v = ev.section("lr_scheduler").get("learning_rate")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _steps_configured(ev: RunEvidence) -> int | None:
    v = ev.section("training").get("steps")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _max_norm(ev: RunEvidence) -> float | None:
    v = ev.section("training").get("max_norm", 1.0 if ev.config else None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _schedule(ev: RunEvidence) -> Any:
    """The lr schedule as the trainer builds it, or None when the config is missing or unreadable."""
    if "schedule" in ev.cache:
        return ev.cache["schedule"]
    steps = _steps_configured(ev)
    schedule = None
    if ev.section("lr_scheduler") and steps is not None:
        import logging

        from lmforge.lr import build_scheduler

        quiet = logging.getLogger("lmforge.lr")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # its warnings were logged when the run started
        try:
            schedule = build_scheduler(ev.section("lr_scheduler"), steps)
        except Exception:  # the doctor diagnoses; a config the trainer would reject is not its business
            schedule = None
        finally:
            quiet.setLevel(level)
    ev.cache["schedule"] = schedule
    return schedule


def _warmup_steps(ev: RunEvidence) -> int | None:
    sched = _schedule(ev)
    return int(getattr(sched, "warmup_steps", 0) or 0) if sched is not None else None


def _after_warmup(ev: RunEvidence, key: str) -> list[tuple[int, float]]:
    warm = _warmup_steps(ev) or 0
    return [(s, v) for s, v in ev.series(key) if s > warm]


def _loss_scaling_on(config: dict[str, Any]) -> bool:
    """Any key naming loss scaling (``loss_scale``, ``scale_sense``, ...) set to something truthy."""

    def walk(node: Any, path: str) -> bool:
        if isinstance(node, dict):
            return any(walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        if re.search(r"loss_scal|scale_sense|grad_scaler", path):
            return node not in (None, False, 0, 1, 1.0, "", "none", "None")
        return False

    return walk(config, "")


# --- the rules --------------------------------------------------------------------------------------


def lr_zero(ev: RunEvidence) -> RuleResult:
    lrs = ev.series("lr")
    if len(lrs) < MIN_STEPS:
        return None
    if any(v != 0 for _, v in lrs):
        return f"the lr is above 0 (peak {_fmt(max(v for _, v in lrs))})"
    base = _base_lr(ev)
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
    if lrs and peak_seen >= WARMUP_UNREACHED * base:
        return None
    lr_sched = ev.section("lr_scheduler")
    target = max(1, round(0.03 * end))
    if lr_sched.get("warmup_ratio") is not None and lr_sched.get("warmup_steps") is None:
        keys: dict[str, Any] = {"lr_scheduler.warmup_ratio": 0.03}
    else:
        keys = {"lr_scheduler.warmup_steps": target}
    where = f"decay_steps {decay}" if decay is not None and decay < steps else f"training.steps {steps}"
    return Finding(
        symptom="loss does not decrease (or barely)",
        evidence=(
            f"warm-up lasts {warm} steps, longer than {where}; the lr only reached "
            f"{_fmt(peak_seen)} of lr_scheduler.learning_rate {_fmt(base)}; {_loss_text(ev)}"
        ),
        cause="warm-up longer than the decay / the run: the lr never leaves the bottom of its ramp",
        keys=keys,
    )


def lr_tiny(ev: RunEvidence) -> RuleResult:
    lrs = ev.series("lr")
    if len(lrs) < MIN_STEPS or _opt_type(ev).lower() not in ("adamw", "adam", "lamb", "muon", "lion"):
        return None
    peak = max(v for _, v in lrs)
    if peak == 0 or peak >= TINY_LR:
        return f"peak lr {_fmt(peak)} is in the usual range" if peak else None
    if _warmup_steps(ev) and peak < WARMUP_UNREACHED * (_base_lr(ev) or 0):
        return None  # the warm-up rule explains it
    return Finding(
        symptom="loss decreases much slower than expected",
        evidence=f"the peak lr is {_fmt(peak)}; {_loss_text(ev)}",
        cause=f"learning rate too small for {_opt_type(ev)} (the article's range is 1e-4 .. 3e-4)",
        keys={"lr_scheduler.learning_rate": 3e-4},
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
    opt = _optimizer(ev)
    wd = opt.get("weight_decay")
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


def _nonfinite_steps(ev: RunEvidence) -> list[int]:
    bad = []
    for r in ev.metrics:
        values = [r.get("loss"), r.get("grad_norm")]
        reason = str(r.get("skip_reason") or "")
        if (
            any(isinstance(v, float) and not math.isfinite(v) for v in values)
            or "finite" in reason
            or "nan" in reason.lower()
        ):
            bad.append(int(r.get("step", 0)))
    return bad


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
    keys: dict[str, Any] = {"lr_scheduler.learning_rate": base / 10} if base else {}
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
        keys["lr_scheduler.learning_rate"] = base / 10
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
        keys={"lr_scheduler.learning_rate": base / 10} if base else {},
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
        keys["lr_scheduler.learning_rate"] = base / 2
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


def _expert_loads(ev: RunEvidence) -> list[tuple[str, float, int]]:
    """(where, largest share of a layer's routed tokens one expert got, experts) over the run's second
    half: from the monitor files (``monitor.moe_monitor``), else from the live doctor's metric."""
    out = []
    for layer, rows in sorted(ev.tokens_per_expert.items()):
        recent = rows[len(rows) // 2 :]
        totals = [sum(col) for col in zip(*recent)]
        s = sum(totals)
        if s:
            out.append((f"layer {layer}", max(totals) / s, len(totals)))
    experts = ev.facts.get("moe_num_experts")
    if not out and experts:
        recs = [r for r in ev.metrics if isinstance(r.get("moe_max_expert_share"), (int, float))]
        recent = recs[len(recs) // 2 :]
        if recent:
            share = sum(r["moe_max_expert_share"] for r in recent) / len(recent)
            layers = sorted({int(r.get("moe_max_expert_share_layer", -1)) for r in recent})
            out.append((f"layer(s) {layers}", share, int(experts)))
    return out


def _moe_keys(ev: RunEvidence) -> dict[str, Any]:
    model = ev.section("model")
    coeff = model.get("moe_aux_loss_coeff", model.get("router_aux_loss_coef"))
    keys: dict[str, Any] = {}
    if model.get("moe_router_load_balancing_type") == "none" or not coeff:
        keys["model.moe_router_load_balancing_type"] = "aux_loss"
        keys["model.moe_aux_loss_coeff"] = 1e-3
    else:
        keys["model.moe_aux_loss_coeff"] = float(coeff) * 10
    if not model.get("moe_router_enable_expert_bias"):
        keys["model.moe_router_enable_expert_bias"] = True
    return keys


def moe_routing(ev: RunEvidence) -> RuleResult:
    loads = _expert_loads(ev)
    if not loads:
        return None
    top_k = ev.section("model").get("num_experts_per_tok") or ev.facts.get("moe_top_k") or 1
    # With top-k routing a token's k picks are distinct experts: one expert holds at most 1/k of them.
    collapse_at = COLLAPSE_SHARE / top_k
    where, share, n = max(loads, key=lambda x: x[1] * x[2])
    if n > top_k and share >= collapse_at:
        return Finding(
            symptom="MoE routing collapse",
            evidence=f"{where}: one expert takes {100 * share:.0f}% of the routed tokens over the last half of the "
            f"run ({n} experts, top-{top_k}: a balanced expert takes {100 / n:.0f}%)",
            cause="the router sends (almost) every token to the same expert(s); the others never train",
            keys=_moe_keys(ev),
        )
    ratio = share * n
    if ratio >= IMBALANCE_RATIO:
        return Finding(
            symptom="MoE load imbalance",
            evidence=f"{where}: the busiest expert gets {ratio:.1f}x the mean load over the last half of the run",
            cause="routing imbalance: the load balancing is too weak for this model",
            keys=_moe_keys(ev),
        )
    return f"expert loads within {IMBALANCE_RATIO:g}x of the mean (busiest {ratio:.1f}x)"


def _memory_options(ev: RunEvidence) -> list[tuple[dict[str, Any], int, int]] | None:
    """(keys, estimated bytes per GPU, number of remedies) for the run as configured and for each single remedy, from the
    same estimate as ``lmforge check`` / ``lmforge plan``; None when the config cannot be built."""
    try:
        from lmforge.config import load_config
        from lmforge.models import build_model, build_model_config
        from lmforge.parallel import BatchSchedule, ParallelDims
        from lmforge.tools.memory import estimate_memory

        cfg = load_config(ev.config)
        mc = build_model_config(cfg.model)
        net = build_model(cfg.model, device="meta")
        world = int(ev.facts.get("world_size") or (ev.checkpoint or {}).get("world_size") or 1)
        dims = ParallelDims.from_section(cfg.parallelism, world)
    except Exception:  # a config from another version, a model lmforge cannot build: no estimate
        return None
    training = ev.section("training")
    lbs = int(training.get("local_batch_size", 1))
    gbs = int(training.get("global_batch_size", lbs))
    opt_type = _opt_type(ev)
    recompute_on = str(ev.section("recompute").get("mode", "None")) == "full"

    moments = 2 if _optimizer(ev).get("moment_dtype") == "bfloat16" else 4

    def estimate(
        lbs_: int = lbs, recompute: bool = recompute_on, offload: bool = False, moment_bytes: int = moments
    ) -> int:
        est = estimate_memory(
            net,
            dims,
            compute_dtype=mc.compute_dtype,
            optimizer_type=opt_type,
            seq_length=mc.seq_length,
            local_batch_size=lbs_,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            vocab_size=mc.vocab_size,
            accumulation_steps=BatchSchedule(gbs, max(1, lbs_), dims.dp).accumulation_steps_at(0),
            moment_bytes=moment_bytes,
            offload_states=offload,
        )
        return est.total(recompute=recompute)

    remedies: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (YAML keys, estimate() arguments)
    if not recompute_on:
        full = {"recompute.mode": "full", "recompute.full_recompute_layer": [f"0-{mc.num_layers - 1}"]}
        remedies.append((full, {"recompute": True}))
    if opt_type.lower() in ("adamw", "lamb", "lion") and not _optimizer(ev).get("offload_states"):
        remedies.append(({"optimizer.offload_states": True}, {"offload": True}))
    if moments == 4 and opt_type.lower() in ("adamw", "muon"):
        remedies.append(({"optimizer.moment_dtype": "bfloat16"}, {"moment_bytes": 2}))  # state compression
    if lbs > 1:
        remedies.append(({"training.local_batch_size": lbs // 2}, {"lbs_": lbs // 2}))
    singles = sorted(((k, a, estimate(**a)) for k, a in remedies), key=lambda r: r[2])
    options: list[tuple[dict[str, Any], int, int]] = [({}, estimate(), 0)]  # (keys, bytes, remedies)
    options += [(k, b, 1) for k, _, b in singles]
    # Remedies applied one after the other, largest saving first.
    keys: dict[str, Any] = {}
    args: dict[str, Any] = {}
    for i, (k, a, _) in enumerate(singles):
        keys, args = {**keys, **k}, {**args, **a}
        if i > 0:
            options.append((dict(keys), estimate(**args), i + 1))
    return options


def out_of_memory(ev: RunEvidence) -> RuleResult:
    if not ev.log_lines:
        return None
    hit = next(
        (
            ln
            for ln in ev.log_lines
            if re.search(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC", ln, re.I)
        ),
        None,
    )
    if hit is None:
        return "train.log reports no out-of-memory error"
    from lmforge.tools.memory import format_bytes

    options = _memory_options(ev) if ev.config else None
    capacity = ev.facts.get("device_memory_bytes")
    keys: dict[str, Any] = {}
    evidence = f"train.log: {hit.strip()[:200]}"
    if options:
        current = options[0][1]
        remedies = options[1:]
        evidence += f"; estimated peak per GPU as configured {format_bytes(current)}"
        evidence += "; with " + "; with ".join(f"{', '.join(k)}: {format_bytes(b)}" for k, b, _ in remedies)
        fitting = [o for o in remedies if capacity and o[1] <= 0.9 * capacity]
        # The smallest change that fits the device (10% headroom), else the largest saving.
        chosen = min(fitting, key=lambda o: (o[2], o[1])) if fitting else min(remedies, key=lambda o: o[1])
        keys.update(chosen[0])
        if capacity:
            evidence += f" (device: {format_bytes(capacity)})"
    else:
        if str(ev.section("recompute").get("mode", "None")) in ("None", "none", ""):
            keys["recompute.mode"] = "full"
        lbs = ev.section("training").get("local_batch_size")
        if isinstance(lbs, int) and lbs > 1:
            keys["training.local_batch_size"] = lbs // 2
    return Finding(
        symptom="out of memory",
        evidence=evidence,
        cause="the step does not fit: activations, optimizer states or both; `lmforge plan` lists the layouts "
        "that fit a number of GPUs",
        keys=keys,
    )


def rank_differences(ev: RunEvidence) -> RuleResult:
    if len(ev.rank_losses) < 2:
        return None
    means = {r: sum(v[len(v) // 2 :]) / len(v[len(v) // 2 :]) for r, v in ev.rank_losses.items()}
    mid = median(means.values())
    off = {r: m for r, m in means.items() if mid and abs(m - mid) / abs(mid) > RANK_LOSS_REL}
    if not off:
        return f"the {len(means)} ranks' local losses agree (within {100 * RANK_LOSS_REL:.0f}% of the median)"
    return Finding(
        symptom="results differ between ranks",
        evidence="; ".join(
            f"rank {r}: mean local loss {_fmt(m)} vs median {_fmt(mid)}" for r, m in sorted(off.items())
        ),
        cause="ranks do not train the same model: parameter groups, config or code differ between ranks "
        "(run every rank with the same train.yaml and lmforge version)",
        keys={},
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


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _matches(rule: str, name: str) -> bool:
    from fnmatch import fnmatchcase

    return rule == name or rule in name or fnmatchcase(name, rule)


# The table: (rule, the article's / issue's row, what it reads). Order = order of the report.
RULES: list[Rule] = [
    Rule("lr_zero", "loss not decreasing", "metrics lr", lr_zero),
    Rule("warmup_never_ends", "loss not decreasing", "config lr_scheduler + metrics lr", warmup_never_ends),
    Rule("schedule_ended", "loss not decreasing", "config lr_scheduler", schedule_ended),
    Rule("parameters_not_updated", "loss not decreasing", "doctor_facts.json", parameters_not_updated),
    Rule("decay_on_everything", "loss not decreasing", "doctor_facts.json", decay_on_everything),
    Rule("lr_tiny", "loss slower than expected", "metrics lr", lr_tiny),
    Rule("weight_decay_too_high", "loss slower than expected", "config optimizer", weight_decay_too_high),
    Rule("eps_too_large", "loss slower than expected", "config optimizer", eps_too_large),
    Rule("loss_diverges_or_spikes", "oscillation and spikes", "metrics loss", loss_diverges_or_spikes),
    Rule(
        "clipping_most_steps",
        "oscillation and spikes",
        "metrics grad_norm + training.max_norm",
        clipping_most_steps,
    ),
    Rule("grad_norm_spikes", "oscillation and spikes", "metrics grad_norm", grad_norm_spikes),
    Rule("max_logits_growing", "oscillation and spikes", "metrics max_attention_logit", max_logits_growing),
    Rule("fp16_without_scaling", "NaN / Inf", "config model.compute_dtype + metrics", fp16_without_scaling),
    Rule("eps_too_small", "NaN / Inf", "config optimizer eps + compute dtype", eps_too_small),
    Rule("nonfinite_values", "NaN / Inf", "metrics loss, grad_norm, skip_reason", nonfinite_values),
    Rule("out_of_memory", "out of memory", "train.log", out_of_memory),
    Rule(
        "moe_routing", "MoE routing collapse / imbalance", "monitor tokens_per_expert or metrics", moe_routing
    ),
    Rule("rank_differences", "differences between ranks", "monitor train_state local_loss", rank_differences),
    Rule("loss_flat", "loss not decreasing", "metrics loss", loss_flat),
]


def diagnose(ev: RunEvidence, rules: list[Rule] | None = None) -> Diagnosis:
    findings: list[Finding] = []
    checked: list[str] = []
    for rule in rules or RULES:
        if rule.name == "loss_flat" and findings:
            continue  # the fallback: only when no other rule named a cause
        result = rule.check(ev)
        if isinstance(result, Finding):
            findings.append(result)
        elif isinstance(result, str):
            checked.append(f"{rule.name}: {result}")
    return Diagnosis(findings, checked)
