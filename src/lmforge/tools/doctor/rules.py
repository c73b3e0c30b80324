"""The doctor's rules: one table, each row a symptom of the article's troubleshooting table (§5.5)
or of the issue, with the evidence it needs, the cause it names and the YAML keys it suggests.

A rule is a function ``RunEvidence -> Finding | None | str``: a :class:`Finding` when it sees the
problem, a string (the healthy sign it checked, e.g. "loss fell from 4.19 to 2.06") when it looked
and found nothing, ``None`` when the run holds no evidence for it. Thresholds are chosen so that
healthy runs (the demo, the recipes, the test runs) raise nothing; they are named constants in
``rule_base.py``; the rules live in ``rules_progress.py``, ``rules_stability.py``, ``rules_resources.py``
and ``rules_run.py`` by the rows of the table they belong to.
docs/guide.md ("The training doctor") mirrors :data:`RULES`.
"""

from __future__ import annotations

from lmforge.tools.doctor.evidence import RunEvidence
from lmforge.tools.doctor.rule_base import (  # noqa: F401 - the thresholds, importable from here
    GRAD_SPIKE_FACTOR,
    LOSS_RISE,
    MIN_STEPS,
    SPIKE_FACTOR,
    Diagnosis,
    Finding,
    Rule,
    RuleResult,
)
from lmforge.tools.doctor.rules_progress import (
    decay_on_everything,
    eps_too_large,
    lr_huge,
    lr_tiny,
    lr_zero,
    parameters_not_updated,
    schedule_ended,
    warmup_never_ends,
    weight_decay_too_high,
)
from lmforge.tools.doctor.rules_resources import (
    emulated_compute_dtype,
    moe_routing,
    out_of_memory,
    rank_differences,
)
from lmforge.tools.doctor.rules_run import loss_flat, no_steps, repeated_data, rollbacks
from lmforge.tools.doctor.rules_stability import (
    clipping_most_steps,
    eps_too_small,
    fp16_without_scaling,
    grad_norm_spikes,
    loss_diverges_or_spikes,
    max_logits_growing,
    nonfinite_values,
)

# The table: (rule, the article's / issue's row, what it reads). Order = order of the report.
RULES: list[Rule] = [
    Rule("no_steps", "the run did not train", "metrics.jsonl + train.log", no_steps),
    Rule("lr_zero", "loss not decreasing", "metrics lr", lr_zero),
    Rule("warmup_never_ends", "loss not decreasing", "config lr_scheduler + metrics lr", warmup_never_ends),
    Rule("schedule_ended", "loss not decreasing", "config lr_scheduler", schedule_ended),
    Rule("parameters_not_updated", "loss not decreasing", "doctor_facts.json", parameters_not_updated),
    Rule("decay_on_everything", "loss not decreasing", "doctor_facts.json", decay_on_everything),
    Rule("lr_tiny", "loss slower than expected", "metrics lr", lr_tiny),
    Rule("lr_huge", "oscillation and spikes", "metrics lr", lr_huge),
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
    Rule("emulated_compute_dtype", "slow training", "doctor_facts.json", emulated_compute_dtype),
    Rule(
        "moe_routing", "MoE routing collapse / imbalance", "monitor tokens_per_expert or metrics", moe_routing
    ),
    Rule("rank_differences", "differences between ranks", "monitor train_state local_loss", rank_differences),
    Rule("repeated_data", "the data", "config data paths + doctor_facts.json + metrics", repeated_data),
    Rule("rollbacks", "recovery", "metrics.jsonl rollback events", rollbacks),
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
