"""The vocabulary of the doctor's rules: thresholds, :class:`Finding` / :class:`Diagnosis` / :class:`Rule`,
and the readings of the evidence that several rules share (loss trend, schedule, optimizer settings).

Thresholds are chosen so that healthy runs (the demo, the recipes, the test runs) raise nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmforge.tools.doctor.evidence import RunEvidence

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


RANK_LOSS_REL = 0.25
# The highest peak lr at which any model (toy models included) of an Adam-type or Muon optimizer trains;
# above it a run cannot be healthy (lr_huge).
LR_CEILING = 0.1
# No suggested lr is above this: it must be a fix, not another divergence (a run at lr 10 told "lr 1").
SUGGESTED_LR_MAX = 1e-2
SAFE_LR = 3e-4  # the article's range is 1e-4 .. 3e-4: the suggestion when a tenth is still too high  # a rank's mean local loss 25% away from the median of the ranks


@dataclass
class Finding:
    symptom: str
    evidence: str
    cause: str
    keys: dict[str, Any] = field(default_factory=dict)
    # The run did not train at all (it died before its first step): `lmforge doctor` exits 1.
    fatal: bool = False

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


def optimizer_setting(ev: RunEvidence, name: str) -> Any:
    """The value of ``optimizer.<name>`` in the run: as its config.yaml wrote it, else the default of the
    optimizer type's schema (lmforge.optim.specs, the one owner of those defaults: the saved file keeps
    only the keys the user wrote); None when the run left no config.yaml or the type has no such key."""
    opt = _optimizer(ev)
    if name in opt:
        return opt[name]
    if not ev.config:
        return None
    from lmforge.optim.specs import OPTIMIZER_TYPES  # torch: only when a rule asks

    schema = OPTIMIZER_TYPES.get(_opt_type(ev))
    declared = None if schema is None else schema.model_fields.get(name)
    return None if declared is None else declared.get_default(call_default_factory=True)


def _eps_value(ev: RunEvidence) -> float | None:
    key = _eps_key(ev)
    value = None if key is None else optimizer_setting(ev, key.split(".", 1)[1])
    if isinstance(value, str):  # a number written as a string ("1e-8"), as the schema reads it
        from lmforge.config.base import number_from_string

        value = number_from_string(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _compute_dtype(ev: RunEvidence) -> str:
    # What the model computed in (doctor_facts.json) wins over the config's `auto`, which names no dtype.
    asked = ev.section("model").get("compute_dtype")
    value = (
        (asked if str(asked).lower() != "auto" else None)
        or ev.facts.get("compute_dtype")
        or asked
        or "bfloat16"
    )
    value = str(value).lower().replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(value, value)


def _base_lr(ev: RunEvidence) -> float | None:
    v = ev.section("lr_scheduler").get("learning_rate")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def healthy_lr(base: float, factor: float = 0.1) -> float:
    """The lr to suggest instead of ``base``: ``base x factor`` when that is at most 1e-2, else the
    article's 3e-4 (a run at lr 10 is not told "lr 1", which diverges too)."""
    lowered = base * factor
    return lowered if lowered <= SUGGESTED_LR_MAX else SAFE_LR


def _steps_configured(ev: RunEvidence) -> int | None:
    # With training.epochs the config holds no steps: the run derived them (doctor_facts.json).
    v = ev.section("training").get("steps", ev.facts.get("training_steps"))
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

        from lmforge.config import validate_section
        from lmforge.lr import build_scheduler

        quiet = logging.getLogger("lmforge.lr")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # its warnings were logged when the run started
        try:
            schedule = build_scheduler(validate_section("lr_scheduler", ev.section("lr_scheduler")), steps)
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


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _matches(rule: str, name: str) -> bool:
    from fnmatch import fnmatchcase

    return rule == name or rule in name or fnmatchcase(name, rule)
