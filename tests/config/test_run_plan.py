"""The run plan: degrees, accumulation steps, batch schedule, warm-up, and every pre-build refusal."""

from __future__ import annotations

from typing import Any

import pytest

from lmforge.config import load_config, validate_section
from lmforge.errors import ConfigError
from lmforge.parallel.plan import BatchSchedule, RunPlan
from lmforge.train.preflight import preflight


@pytest.fixture
def base_config(base_config: dict[str, Any]) -> dict[str, Any]:
    """The shared base with a model small enough to split over 4 tensor/context-parallel ranks."""
    base_config["model"].update(num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    return base_config


def _plan(base: dict[str, Any], world: int = 1, **sections: Any) -> RunPlan:
    for name, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(name, {}).update(values)
        else:
            base[name] = values
    return preflight(load_config(base), world)


def _refused(base: dict[str, Any], world: int = 1, **sections: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _plan(base, world, **sections)
    return str(info.value)


def test_pure_fsdp_shards_over_every_rank(base_config: dict[str, Any]) -> None:
    p = _plan(base_config, 8, training={"local_batch_size": 2, "global_batch_size": 64})
    assert (p.dims.dp, p.dims.dp_replicate, p.dims.dp_shard) == (8, 1, 8)
    # No warning about the batch; on a CPU that emulates bf16 (the base config's dtype) preflight says so.
    batch_warnings = [w for w in p.warnings if not w.startswith("model.compute_dtype")]
    assert p.accumulation_steps == 4 and p.effective_global_batch_size == 64 and batch_warnings == []


def test_hsdp_split(base_config: dict[str, Any]) -> None:
    p = _plan(base_config, 8, parallelism={"data_parallel_shard": 2}, training={"global_batch_size": 8})
    assert (p.dims.dp_replicate, p.dims.dp_shard) == (4, 2)


def test_floor_division_warns(base_config: dict[str, Any]) -> None:
    p = _plan(base_config, 2, training={"local_batch_size": 2, "global_batch_size": 10})
    assert p.accumulation_steps == 2 and p.effective_global_batch_size == 8
    assert any("effective global batch is 8" in w for w in p.warnings)


def test_world_size_that_tensor_parallel_does_not_divide_is_a_clear_error(
    base_config: dict[str, Any],
) -> None:
    text = _refused(base_config, 3, parallelism={"tensor_parallel": 2}, training={"global_batch_size": 4})
    assert "world size 3 is not divisible by parallelism.tensor_parallel(2)" in text


def test_rampup_batches_must_divide(base_config: dict[str, Any]) -> None:
    base_config["training"].update(global_batch_size=12, rampup_batch_size=[4, 4, 100])
    plan = preflight(load_config(base_config), 2)
    assert plan.accumulation_steps == 2 and plan.batches.global_batch_at(10_000) == 12
    base_config["training"].update(rampup_batch_size=[3, 3, 100])
    with pytest.raises(ConfigError, match=r"training\.rampup_batch_size: the global batch size 3"):
        preflight(load_config(base_config), 2)


def test_rampup_with_pipeline_parallel_is_refused(base_config: dict[str, Any]) -> None:
    text = _refused(
        base_config,
        2,
        parallelism={"pipeline_parallel": 2},
        training={"global_batch_size": 8, "rampup_batch_size": [2, 2, 100]},
    )
    assert "training.rampup_batch_size cannot be combined with parallelism.pipeline_parallel > 1" in text


def test_swap_with_pipeline_parallel_is_refused(base_config: dict[str, Any]) -> None:
    text = _refused(
        base_config,
        2,
        parallelism={"pipeline_parallel": 2},
        training={"global_batch_size": 4},
        swap={"enable": True, "layer_swap": [{"layers": ["0"]}]},
    )
    assert "swap" in text and "pipeline" in text


@pytest.mark.parametrize(
    ("scheduler", "steps", "expected"),
    [
        ({"warmup_steps": 3}, 10, 3),
        ({"warmup_ratio": 0.1, "warmup_steps": 3}, 100, 10),
        ({"warmup_ratio": 0.015}, 1000, 15),
        ({}, 100, 0),
    ],
)
def test_warmup_steps(
    base_config: dict[str, Any], scheduler: dict[str, Any], steps: int, expected: int
) -> None:
    base_config["lr_scheduler"] = {"type": "ConstantWarmUpLR", **scheduler}
    base_config["training"]["steps"] = steps
    assert preflight(load_config(base_config), 1).schedule.boundaries().get("warm-up end", 0) == expected


def test_misspelled_scheduler_key_and_bad_model_key_are_reported_together(
    base_config: dict[str, Any],
) -> None:
    base_config["lr_scheduler"]["warmup_stpes"] = 3
    base_config["model"]["num_hiden_layers"] = 2
    text = _refused(base_config)
    assert "lr_scheduler.warmup_stpes" in text and "model.num_hiden_layers" in text and "2 problems" in text


def test_unknown_callback_type_is_refused(base_config: dict[str, Any]) -> None:
    text = _refused(base_config, callbacks=[{"type": "NoSuchCallback"}])
    assert "callbacks[0].type: unknown callback 'NoSuchCallback'" in text


def test_select_module_pattern_matching_nothing_is_refused(base_config: dict[str, Any]) -> None:
    text = _refused(base_config, recompute={"mode": "select", "select_module": {"no_such_module": ["0"]}})
    assert "recompute.select_module['no_such_module']" in text and "matches no submodule" in text
    ok = _plan(base_config, recompute={"mode": "select", "select_module": {"mlp": ["0"]}})
    assert ok.activation_summary


def test_cp_method_hybrid_is_accepted(base_config: dict[str, Any]) -> None:
    plan = _plan(
        base_config,
        4,
        parallelism={"context_parallel": 4, "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 2},
        training={"global_batch_size": 1},
    )
    assert plan.dims.cp == 4 and plan.dims.ulysses == 2


def test_batch_schedule_ramp_up() -> None:
    b = BatchSchedule(global_batch_size=12, local_batch_size=1, data_parallel=2, rampup=(4, 4, 100))
    assert [b.global_batch_at(c) for c in (0, 49, 50, 100)] == [4, 4, 8, 12]
    assert b.accumulation_steps_at(0) == 2 and b.problems() == []


def test_every_unknown_model_key_is_named_at_once(base_config: dict[str, Any]) -> None:
    base_config["model"].update(num_hiden_layers=2, hiden_size=8)
    text = _refused(base_config)
    assert "model.num_hiden_layers" in text and "model.hiden_size" in text


def test_accepted_keys_that_change_nothing_warn(base_config: dict[str, Any]) -> None:
    base_config["model"].update(torch_dtype="bfloat16", eos_token_id=2)
    base_config["parallelism"] = {"context_parallel_async": True}
    base_config["train_dataset"]["dataloader"].update(bogus_one=1, bogus_two=2)
    # load_config warns about the model's keys (cfg.warnings), the plan about the others; check prints both.
    warnings = " | ".join([*load_config(base_config).warnings, *_plan(base_config).warnings])
    assert "model.torch_dtype, model.eos_token_id accepted but have no effect" in warnings
    assert "context_parallel_async: true has no effect with context_parallel 1" in warnings
    assert "train_dataset.dataloader.bogus_one, train_dataset.dataloader.bogus_two are not used" in warnings


def test_spec_literal_adamw_include_keeps_embedding_and_output_layer_on_adamw(
    base_config: dict[str, Any],
) -> None:
    import torch

    from lmforge.models.build import build_from_config
    from lmforge.optim import build_optimizer

    base_config["optimizer"] = {"type": "Muon", "adamw_include": ["word_embeddings", "output_layer"]}
    plan = _plan(base_config)
    assert not any("matches no parameter" in w for w in plan.warnings)
    model = build_from_config(
        plan.model_config, plan.model_class, "cpu"
    ).float()  # the trainer's fp32 parameters
    opt = build_optimizer(plan.optimizer, model, 1e-3)
    ids = {id(p): n for n, p in model.named_parameters()}
    routed = {
        ids[id(p)]: g.get("route", g.get("optimizer", "?")) for g in opt.param_groups for p in g["params"]
    }
    muon_names = [n for n, r in routed.items() if "muon" in str(r).lower()]
    assert muon_names and not any("word_embeddings" in n or "output_layer" in n for n in muon_names)
    assert isinstance(model.embedding.word_embeddings.weight, torch.nn.Parameter)


def test_parameter_pattern_matching_nothing_is_reported(base_config: dict[str, Any]) -> None:
    base_config["optimizer"] = {"weight_decay_exclude": ["no_such_param"], "lr_scale": {"embedding": 0.5}}
    # load_config warns about the model's keys (cfg.warnings), the plan about the others; check prints both.
    warnings = " | ".join([*load_config(base_config).warnings, *_plan(base_config).warnings])
    assert "optimizer.weight_decay_exclude: the pattern 'no_such_param' matches no parameter" in warnings
    assert "'embedding'" not in warnings


def test_recompute_comm_spec_example_attention_qkv_is_accepted_under_tensor_parallel(
    base_config: dict[str, Any],
) -> None:
    plan = _plan(
        base_config,
        2,
        parallelism={"tensor_parallel": 2},
        training={"global_batch_size": 1},
        recompute_comm={"enable": True, "select_module": {"attention.qkv": ["0-3"]}},
    )
    assert "recompute_comm" in (plan.activation_summary or "")


def test_bare_substring_pattern_is_reported_with_the_glob_to_write(base_config: dict[str, Any]) -> None:
    base_config["optimizer"] = {"weight_decay_exclude": ["norm"]}
    # load_config warns about the model's keys (cfg.warnings), the plan about the others; check prints both.
    warnings = " | ".join([*load_config(base_config).warnings, *_plan(base_config).warnings])
    assert "'norm' matches no parameter" in warnings and "write '*norm*'" in warnings


def test_found_by_exhaustive_corruption_of_the_shipped_configs(base_config: dict[str, Any]) -> None:
    # A negative MLA query rank crashed inside the model constructor; a too-large local batch did not
    # name training.local_batch_size.
    text = _refused(base_config, training={"local_batch_size": 7, "global_batch_size": 2})
    assert "training.local_batch_size 7" in text
    from lmforge.models import build_model_config

    ds3 = {"model_type": "deepseek_v3", "architectures": "DeepseekV3ForCausalLM", "q_lora_rank": -1}
    with pytest.raises(ConfigError, match=r"model\.q_lora_rank = -1 must be a non-negative integer"):
        build_model_config(validate_section("model", ds3))
    assert build_model_config(validate_section("model", {**ds3, "q_lora_rank": 0})).q_lora_rank is None
    qwen = {"model_type": "qwen3", "architectures": "Qwen3ForCausalLM", "hidden_size": 64}
    for key, value in (
        ("head_dim", -1),
        ("num_key_value_heads", -2),
        ("rms_norm_eps", 0),
        ("initializer_range", -1),
    ):
        with pytest.raises(ConfigError, match=rf"model\.{key} = {value}"):
            build_model_config(validate_section("model", {**qwen, key: value}))


def test_cpu_offload_on_one_process_is_decided_by_preflight_for_the_device(
    base_config: dict[str, Any], monkeypatch: Any
) -> None:
    import torch

    base_config["parallelism"] = {"cpu_offload": True}
    cfg = load_config(base_config)
    # On a CPU: a no-op, said so in the plan's warnings (check prints them, train logs them).
    assert any("cpu_offload: true has no effect" in w for w in preflight(cfg, 1, "cpu").warnings)
    # On an accelerator, given or found (CUDA available, faked here): FSDP2 wraps one process too and
    # offloads, nothing to say.
    assert not any("cpu_offload" in w for w in preflight(cfg, 1, "cuda").warnings)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not any("cpu_offload" in w for w in preflight(cfg, 1).warnings)
    assert not any("cpu_offload" in w for w in preflight(cfg, 2, "cuda").warnings)  # FSDP2 applies it
