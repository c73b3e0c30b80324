"""The doctor never calls a broken run healthy: a run without steps, an lr far out of range (and its
suggested fix), repeated data, warm-up, a warm-up longer than decay_steps, recovery's rollbacks."""

from __future__ import annotations

import json
import math

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.lr import build_scheduler
from lmforge.tools.doctor import diagnose, read_run_dir
from lmforge.tools.doctor.rule_base import SUGGESTED_LR_MAX

from .test_rules_synthetic import CONFIG, _healthy, _write_run


def _symptoms(run):
    return [f.symptom for f in diagnose(read_run_dir(run)).findings]


def test_a_run_that_died_before_its_first_step_is_a_finding_with_a_non_zero_exit(tmp_path, capsys):
    log = "INFO building the model\nTraceback (most recent call last):\nFileNotFoundError: data/corpus.bin\n"
    run = _write_run(tmp_path, [], log=log)
    (f,) = diagnose(read_run_dir(run)).findings
    assert f.symptom == "the run never completed a step" and f.fatal
    assert "FileNotFoundError: data/corpus.bin" in f.evidence
    assert main(["doctor", str(run)]) == 1
    assert "never completed a step" in capsys.readouterr().out
    assert main(["doctor", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert set(report["findings"][0]) == {"symptom", "evidence", "cause", "keys"}  # the JSON contract holds


def test_lr_10_gets_a_fix_in_the_healthy_range_and_no_healthy_sign(tmp_path):
    config = CONFIG.replace("learning_rate: 3.0e-4", "learning_rate: 10.0").replace(
        "lr_end: 3.0e-5", "lr_end: 1.0"
    )
    records = _healthy(lr=10.0)
    for r in records[10:]:
        r["loss"] = 4.0 + 0.3 * (r["step"] % 3) + 0.05 * r["step"]  # oscillating, then rising
    run = _write_run(tmp_path, records, config=config)
    diagnosis = diagnose(read_run_dir(run))
    assert "learning rate far above the usual range" in [f.symptom for f in diagnosis.findings]
    suggested = [
        f.keys["lr_scheduler.learning_rate"]
        for f in diagnosis.findings
        if "lr_scheduler.learning_rate" in f.keys
    ]
    assert suggested and all(0 < lr <= SUGGESTED_LR_MAX for lr in suggested)  # never "lr 1"
    # "peak lr 10 is in the usual range" is no healthy sign
    assert not any(c.startswith("lr_tiny") for c in diagnosis.checked)


def test_a_healthy_lr_is_still_a_healthy_sign(tmp_path):
    diagnosis = diagnose(read_run_dir(_write_run(tmp_path, _healthy())))
    assert diagnosis.findings == []
    assert any(c.startswith("lr_tiny: peak lr 0.0003 is in the usual range") for c in diagnosis.checked)


def test_several_epochs_of_a_tiny_set_is_a_finding(tmp_path):
    records = _healthy(consumed_samples=lambda s: 8 * s)  # 320 samples of a 16-sample set: 20 epochs
    run = _write_run(tmp_path, records)
    (run / "doctor_facts.json").write_text(json.dumps({"train_samples_per_epoch": 16}))
    (f,) = diagnose(read_run_dir(run)).findings
    assert f.symptom == "training on repeated data" and "20.0 epochs" in f.evidence
    assert f.keys == {"training.steps": 8}  # 4 epochs
    (run / "doctor_facts.json").write_text(json.dumps({"train_samples_per_epoch": 320}))
    assert diagnose(read_run_dir(run)).findings == []


def test_validation_data_equal_to_training_data_is_a_finding(tmp_path):
    data = (
        "train_dataset: {dataloader: {type: MegatronDataLoader, config: "
        "{train_data_path: ['/d/corpus_text_document'], valid_data_path: ['/d/corpus_text_document']}}}\n"
    )
    run = _write_run(tmp_path, _healthy(), config=CONFIG + data)
    assert _symptoms(run) == ["validation data is training data"]
    other = tmp_path / "other"
    other.mkdir()
    run = _write_run(
        other,
        _healthy(),
        config=CONFIG + data.replace("valid_data_path: ['/d/corpus", "valid_data_path: ['/d/held_out"),
    )
    assert _symptoms(run) == []


def test_warm_up_is_not_loss_does_not_decrease(tmp_path):
    config = CONFIG.replace("steps: 40", "steps: 2000").replace("warmup_steps: 2", "warmup_steps: 100")
    records = [{"step": s, "loss": 4.0, "lr": 3e-4 * s / 100, "grad_norm": 0.8} for s in range(1, 21)]
    diagnosis = diagnose(read_run_dir(_write_run(tmp_path, records, config=config)))
    assert diagnosis.findings == []
    assert any("still in its warm-up (step 20 of 100)" in c for c in diagnosis.checked)


def test_warm_up_longer_than_decay_steps_is_a_finding_on_the_run(tmp_path):
    # The spec's case: the lr ramps for decay_steps, then sits at lr_end while the loss stalls. It reaches
    # more than half the peak before, which the rule used to take for a healthy warm-up.
    sched_cfg = {
        "type": "CosineWithWarmUpLR",
        "learning_rate": 3e-4,
        "warmup_steps": 30,
        "decay_steps": 20,
        "lr_end": 3e-5,
    }
    schedule = build_scheduler(validate_section("lr_scheduler", sched_cfg), 200)
    config = CONFIG.replace("steps: 40", "steps: 200").replace(
        "warmup_steps: 2, lr_end: 3.0e-5", "warmup_steps: 30, decay_steps: 20, lr_end: 3.0e-5"
    )
    records = [
        {"step": s, "loss": 4.0 - 0.02 * min(s, 20), "lr": schedule.lr_at(s - 1), "grad_norm": 0.8}
        for s in range(1, 201)
    ]
    assert max(r["lr"] for r in records) >= 0.5 * 3e-4 and math.isclose(records[-1]["lr"], 3e-5)
    findings = diagnose(read_run_dir(_write_run(tmp_path, records, config=config))).findings
    (f,) = [f for f in findings if "warm-up longer than the decay" in f.cause]
    assert "from step 20 on the lr sits at lr_end" in f.evidence


def test_rollbacks_are_a_finding_and_the_curve_rules_judge_the_run_as_it_went(tmp_path):
    records = _healthy()
    spike = dict(records[20], step=21, loss=40.0)
    event = {
        "event": "rollback",
        "step": 21,
        "to_step": 18,
        "reason": "loss spike: ...",
        "skipped_samples": [144, 167],
        "replayed_samples": None,
        "data": "skip",
    }
    run = _write_run(tmp_path, [*records[:20], spike, event, *records[18:]])
    ev = read_run_dir(run)
    assert [r["step"] for r in ev.metrics] == list(range(1, 41)) and len(ev.rollbacks) == 1
    (f,) = diagnose(ev).findings
    assert f.symptom == "training rolled back 1 time(s)"
    assert "step 21 -> 18" in f.evidence and "samples 144..167 skipped" in f.evidence
