"""One tiny `build_trainer` run with every observability and activation-memory feature switched on."""

from __future__ import annotations

import json

import pytest

from cli.test_eval_cli import _write_data
from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import read_metrics
from tiny_train_config import megatron_train_dataset

from .test_tensorboard_profiler_memory import _scalars, _trace_step_names

TOP_K = 2


@pytest.fixture
def run(tmp_path):
    prefix = tmp_path / "docs"
    _write_data(prefix)
    raw = {
        "output_dir": str(tmp_path / "run"),
        "training": {"steps": 3, "local_batch_size": 2, "global_batch_size": 4, "seed": 3},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1.0e-3, "warmup_steps": 0},
        "checkpoint": {"enable_save": False},
        "model": {
            "model_type": "qwen3_moe",
            "architectures": "Qwen3MoeForCausalLM",
            "num_hidden_layers": 3,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": TOP_K,
            "output_router_logits": True,  # adds the load-balancing loss
            "vocab_size": 64,
            "seq_length": 16,
            "compute_dtype": "float32",
        },
        "train_dataset": megatron_train_dataset(
            prefix, seq_length=16, split="70,30,0", cache=tmp_path / "cache", workers=1
        ),
        "monitor": {
            "train_state": {"local_norm": "word_embeddings", "device_loss": True},
            "moe_monitor": {"save_tokens_per_expert_interval": 1, "target_layers": [0]},
            "tensorboard": {"log_interval": 1},
        },
        "profiler": {"enable_profiling": True, "start_step": 2, "end_step": 2, "with_stack": False},
        "recompute": {"mode": "full", "full_recompute_layer": ["0"]},
        "swap": {"enable": True, "layer_swap": [{"layers": ["1"]}]},
        "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 3}],
        "eval_interval": 2,
        "eval_steps": 2,
    }
    trainer = build_trainer(load_config(raw), output_dir=tmp_path / "run", device="cpu")
    summary = trainer.fit()
    assert summary["status"] == "completed"
    return tmp_path / "run"


@pytest.mark.slow
def test_every_feature_leaves_its_output(run):
    log = (run / "train.log").read_text()
    assert "Activation memory: recompute full: layers 0; swap layers 1 to CPU (prefetch 1)" in log
    assert "validation: step 2, val_loss:" in log
    assert "max_attention_logit/decoder.layers.2.self_attention: [" in log

    records = read_metrics(run / "metrics.jsonl")
    assert [("val_loss" in r) for r in records] == [False, True, False]
    assert records[1]["val_ppl"] > 1 and records[1]["val_tokens"] > 0
    assert all(r["peak_rss_bytes"] > 0 and r["memory_gib"] > 0 for r in records)

    scalars = _scalars(run / "tensorboard")
    for tag in (
        "loss",
        "learning-rate",
        "grad-norm",
        "throughput",
        "memory/peak-rss-bytes",
        "load-balancing-loss",
    ):
        assert [s for s, _ in scalars.get(tag, [])] == [1, 2, 3], (tag, sorted(scalars))
    assert [s for s, _ in scalars["val-loss"]] == [2]
    assert [s for s, _ in scalars["val-loss vs samples"]] == [8]

    state = [
        json.loads(line) for line in (run / "monitor" / "train_state_rank0.jsonl").read_text().splitlines()
    ]
    norms = [r for r in state if "local_norm" in r]
    assert [(r["step"], r["micro_step"]) for r in norms] == [(s, m) for s in (1, 2, 3) for m in (1, 2)]
    assert all(set(r["local_norm"]) == {"embedding.word_embeddings.weight"} for r in norms)
    losses = {r["step"]: r["device_loss"] for r in state if "device_loss" in r}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in records})

    tpe = [
        json.loads(line)
        for line in (run / "monitor" / "tokens_per_expert_rank0.jsonl").read_text().splitlines()
    ]
    assert len(tpe) == 3 * 2 and all(r["layer"] == 0 and sum(r["tpe"]) == 2 * 16 * TOP_K for r in tpe)

    assert _trace_step_names(run / "profile" / "rank_0") == {"ProfilerStep#2"}
