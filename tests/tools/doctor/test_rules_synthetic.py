"""Rules that are pure functions of the recorded numbers, on synthesized run directories.

The real-run tests (test_pathologies.py) cover the rules a tiny model can show in a few steps; these
cover the ones it cannot (attention logits growing for thousands of steps, a NaN from a bad batch, an
OOM, ranks disagreeing) by writing the files a run would have written.
"""

from __future__ import annotations

import json
import math

import pytest

from lmforge.cli import main
from lmforge.errors import LmforgeError
from lmforge.tools.doctor import diagnose, read_run_dir

CONFIG = """\
training: {steps: 40, max_norm: 1.0, local_batch_size: 4, global_batch_size: 8}
optimizer: {type: AdamW, eps: 1.0e-8, weight_decay: 0.1}
lr_scheduler: {type: CosineWithWarmUpLR, learning_rate: 3.0e-4, warmup_steps: 2, lr_end: 3.0e-5}
model: {model_type: qwen3, architectures: Qwen3ForCausalLM, compute_dtype: bfloat16}
"""


def _write_run(tmp_path, records, log="", config=CONFIG):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config)
    with open(run / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (run / "train.log").write_text(log)
    return run


def _healthy(n=40, **extra):
    out = []
    for s in range(1, n + 1):
        r = {"step": s, "loss": 4.0 - 2.0 * s / n, "lr": 3e-4, "grad_norm": 0.8}
        r.update({k: v(s) if callable(v) else v for k, v in extra.items()})
        out.append(r)
    return out


def test_synthetic_healthy_baseline(tmp_path):
    assert diagnose(read_run_dir(_write_run(tmp_path, _healthy()))).findings == []


def test_max_attention_logits_growing_suggests_qk_clip(tmp_path):
    run = _write_run(tmp_path, _healthy(max_attention_logit=lambda s: 20.0 * 1.06**s))
    (f,) = diagnose(read_run_dir(run)).findings
    assert "QK-Clip" in f.cause and f.keys["optimizer.type"] == "Muon"
    assert f.keys["optimizer.qk_clip_threshold"] == 100.0


def test_nan_without_a_precision_cause_lowers_the_lr(tmp_path):
    records = _healthy()
    records[30].update(loss=math.nan, grad_norm=math.nan, skipped=True, skip_reason="non-finite grad norm")
    (f,) = diagnose(read_run_dir(_write_run(tmp_path, records))).findings
    assert f.symptom.startswith("NaN / Inf") and "step 31" in f.evidence
    assert f.keys == {"lr_scheduler.learning_rate": pytest.approx(3e-5)}


def test_grad_norm_spikes(tmp_path):
    records = _healthy()
    records[25]["grad_norm"] = 50.0
    diagnosis = diagnose(read_run_dir(_write_run(tmp_path, records)))
    assert diagnosis.findings == []  # one clipped spike the loss did not follow: a hard batch, not a finding
    assert any("one isolated grad-norm spike (step 26)" in c for c in diagnosis.checked)
    records[33]["grad_norm"] = 40.0
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (f,) = diagnose(read_run_dir(tmp_path / "run")).findings
    assert f.symptom == "grad-norm spikes" and "2 step(s)" in f.evidence and "step 26" in f.evidence


def test_out_of_memory_in_the_log(tmp_path):
    log = "12:00:01 ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    (f,) = diagnose(read_run_dir(_write_run(tmp_path, _healthy(5), log=log))).findings
    assert f.symptom == "out of memory"
    # This config is not a complete train.yaml (no train_dataset): no estimate, the generic remedies.
    assert f.keys == {"recompute.mode": "full", "training.local_batch_size": 2}


def test_out_of_memory_names_the_remedy_that_fits(tmp_path):
    """A complete config and the device size: the estimate of each remedy (check's code) picks one."""
    config = CONFIG.rsplit("model:", 1)[0] + (
        "train_dataset: {dataloader: {type: TextDataLoader, data_path: [unused.jsonl], tokenizer: unused}}\n"
        "model: {model_type: qwen3, architectures: Qwen3ForCausalLM, num_hidden_layers: 2, hidden_size: 256,\n"
        "  num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64, intermediate_size: 768, vocab_size: 2048,\n"
        "  seq_length: 256, compute_dtype: float32}\n"
    )
    log = "12:00:01 ERROR torch.OutOfMemoryError: CUDA out of memory.\n"
    run = _write_run(tmp_path, _healthy(5), log=log, config=config)
    (run / "doctor_facts.json").write_text(json.dumps({"device_memory_bytes": 100 * 2**20}))
    (f,) = diagnose(read_run_dir(run)).findings
    assert "estimated peak per GPU as configured" in f.evidence and "(device: 100.00 MiB)" in f.evidence
    # One remedy (full recompute, the largest saving) fits 90% of 100 MiB.
    assert f.keys == {"recompute.mode": "full", "recompute.full_recompute_layer": ["0-1"]}
    (run / "doctor_facts.json").write_text(json.dumps({"device_memory_bytes": 64 * 2**20}))
    (f,) = diagnose(read_run_dir(run)).findings
    assert len(f.keys) >= 3  # no single remedy fits 64 MiB: recompute and half the micro-batch together


def test_rank_differences_from_train_state_files(tmp_path):
    run = _write_run(tmp_path, _healthy())
    (run / "monitor").mkdir()
    for rank, loss in enumerate([2.0, 2.05, 1.98, 3.5]):
        with open(run / "monitor" / f"train_state_rank{rank}.jsonl", "w") as f:
            for s in range(1, 21):
                f.write(json.dumps({"step": s, "micro_step": 1, "local_loss": loss}) + "\n")
    (f,) = diagnose(read_run_dir(run)).findings
    assert f.symptom == "results differ between ranks" and "rank 3" in f.evidence


def test_moe_imbalance_from_the_monitor_files(tmp_path):
    run = _write_run(tmp_path, _healthy())
    (run / "monitor").mkdir()
    with open(run / "monitor" / "tokens_per_expert_rank0.jsonl", "w") as f:
        for s in range(1, 21):
            f.write(
                json.dumps({"step": s, "micro_step": 1, "layer": 1, "tpe": [70, 10, 10, 10, 10, 10, 0, 0]})
                + "\n"
            )
    (f,) = diagnose(read_run_dir(run)).findings
    assert f.symptom == "MoE load imbalance" and "layer 1" in f.evidence
    assert "model.moe_aux_loss_coeff" in f.keys


def test_cli_json_contract_and_bad_run_dir(tmp_path, capsys):
    records = _healthy()
    records[25]["grad_norm"] = records[33]["grad_norm"] = 50.0
    run = _write_run(tmp_path, records)
    assert main(["doctor", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"findings", "checked"}
    assert set(report["findings"][0]) == {"symptom", "evidence", "cause", "keys"}
    assert main(["doctor", str(run)]) == 0
    text = capsys.readouterr().out
    assert (
        "1. grad-norm spikes" in text
        and "likely cause:" in text
        and "lr_scheduler.learning_rate: 0.00015" in text
    )
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(LmforgeError, match="neither metrics.jsonl nor train.log"):
        read_run_dir(tmp_path)


def test_lora_frozen_base_is_intended_but_a_stuck_adapter_is_not(tmp_path):
    run = _write_run(tmp_path, _healthy(), config=CONFIG + "lora_config: {lora_rank: 8}\n")
    facts = {"frozen": ["decoder.layers.0.mlp.linear_fc1.weight"], "not_in_optimizer": [], "not_updated": []}
    (run / "doctor_facts.json").write_text(json.dumps(facts))
    assert diagnose(read_run_dir(run)).findings == []
    facts["not_updated"] = ["decoder.layers.0.mlp.linear_fc1.lora_B.weight"]
    (run / "doctor_facts.json").write_text(json.dumps(facts))
    (f,) = diagnose(read_run_dir(run)).findings
    assert "lora_B" in f.evidence and "linear_fc1.weight" not in f.evidence.replace("lora_B.weight", "")


def test_an_emulated_16_bit_compute_dtype_is_a_finding_with_the_key_to_change(tmp_path):
    from lmforge.tools.doctor.evidence import FACTS_FILE

    note = (
        "model.compute_dtype = bfloat16: this CPU has no native bfloat16 matmuls and emulates them: a "
        "128x128 matmul measured 40x slower than in float32 here"
    )
    run = _write_run(tmp_path, _healthy(step_time=9.5))
    (run / FACTS_FILE).write_text(json.dumps({"compute_dtype": "bfloat16", "compute_dtype_emulated": note}))
    (f,) = diagnose(read_run_dir(run)).findings
    assert f.symptom.startswith("slow training") and note in f.evidence and "9.5" in f.evidence
    assert f.keys == {"model.compute_dtype": "auto"}
    # The same run where the live doctor found bf16 native: no finding, and it says so.
    (run / FACTS_FILE).write_text(json.dumps({"compute_dtype": "bfloat16"}))
    diagnosis = diagnose(read_run_dir(run))
    assert diagnosis.findings == []
    assert any(
        c.startswith("emulated_compute_dtype: model.compute_dtype bfloat16 is native")
        for c in diagnosis.checked
    )


def test_the_live_doctor_records_an_emulated_compute_dtype(monkeypatch):
    import torch

    from lmforge.train.callbacks import doctor_live as live
    from lmforge.utils import native_dtype

    monkeypatch.setattr(native_dtype, "cpu_capability", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(native_dtype, "cpu_speed_ratio", lambda dtype: (1.0, 0.02))
    model = torch.nn.Linear(4, 4)
    model.compute_dtype = torch.bfloat16
    facts = live.DoctorCallback._parameter_facts(object.__new__(live.DoctorCallback), model, None)
    assert "50x slower" in facts["compute_dtype_emulated"]
    model.compute_dtype = torch.float32
    assert "compute_dtype_emulated" not in live.DoctorCallback._parameter_facts(
        object.__new__(live.DoctorCallback), model, None
    )


def test_an_omitted_optimizer_key_reads_as_its_types_default(tmp_path):
    # config.yaml keeps only the optimizer keys the user wrote; the doctor asks the optimizer type's
    # schema for the rest (Muon's weight decay is 0.1 and its Adam eps 1e-8; LAMB's eps is 1e-6).
    from lmforge.tools.doctor.rule_base import _eps_value, optimizer_setting

    muon = read_run_dir(
        _write_run(
            tmp_path,
            _healthy(),
            config=CONFIG.replace("{type: AdamW, eps: 1.0e-8, weight_decay: 0.1}", "{type: Muon}"),
        )
    )
    assert optimizer_setting(muon, "weight_decay") == 0.1 and _eps_value(muon) == 1e-8
    assert optimizer_setting(muon, "no_such_key") is None
    (tmp_path / "b").mkdir()
    lamb = read_run_dir(
        _write_run(tmp_path / "b", _healthy(), config=CONFIG.replace("AdamW, eps: 1.0e-8", "LAMB"))
    )
    assert _eps_value(lamb) == 1e-6 and optimizer_setting(lamb, "weight_decay") == 0.1


def test_an_lr_held_at_0_by_skipped_steps_is_not_blamed_on_the_lr(tmp_path):
    # Every step skipped (non-finite): the warm-up from 0 never advanced, so the lr is 0 throughout. The
    # cause is what skipped the steps; a learning rate of 0 is not (the schedule's learning_rate is 3e-4).
    nan = {"loss": math.nan, "grad_norm": math.nan, "lr": 0.0, "skipped": True, "skip_reason": "loss is nan"}
    records = [{"step": s, **nan} for s in range(1, 41)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    causes = [f.cause for f in diagnose(read_run_dir(_write_run(tmp_path / "a", records))).findings]
    assert causes and not any(c.startswith("learning rate 0") for c in causes)
    # With the same lr of 0 on applied steps, the lr is the cause.
    applied = [{**r, "loss": 4.0, "grad_norm": 0.8, "skipped": False} for r in records]
    for r in applied:
        r.pop("skip_reason")
    causes = [f.cause for f in diagnose(read_run_dir(_write_run(tmp_path / "b", applied))).findings]
    assert any(c.startswith("learning rate 0") for c in causes)
