"""One test per validation rule: the configuration is refused and the message names the key."""

from __future__ import annotations

from typing import Any

import pytest

from lmforge.config import apply_overrides, load_config
from lmforge.errors import ConfigError


def _refused(base: dict[str, Any], overrides: dict[str, Any]) -> str:
    raw = apply_overrides(base, overrides)
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return str(info.value)


# (overrides on the base config, substrings the message must contain)
RULES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "gbs positive": ({"training.global_batch_size": 0}, ["training.global_batch_size", "must be positive"]),
    "lbs positive": ({"training.local_batch_size": -1}, ["training.local_batch_size", "must be positive"]),
    "steps positive": ({"training.steps": 0}, ["training.steps", "positive"]),
    "max_norm zero": ({"training.max_norm": 0}, ["training.max_norm", "> 0", "zero"]),
    "max_norm negative": ({"training.max_norm": -1.0}, ["training.max_norm", "> 0"]),
    "rampup shape": ({"training.rampup_batch_size": [1, 1]}, ["training.rampup_batch_size", "3-element"]),
    "rampup ints": ({"training.rampup_batch_size": [1, 1.0, 8]}, ["training.rampup_batch_size", "int"]),
    "rampup ranges": ({"training.rampup_batch_size": [0, 1, 8]}, ["training.rampup_batch_size", "> 0"]),
    "rampup increment": (
        {"training.global_batch_size": 8, "training.rampup_batch_size": [1, 2, 8]},
        ["training.rampup_batch_size", "multiple of batch_size_increment"],
    ),
    "rampup start above gbs": (
        {"training.rampup_batch_size": [4, 1, 8]},
        ["training.rampup_batch_size", "exceeds"],
    ),
    "reshard policy": (
        {"parallelism.reshard_after_forward_policy": "sometimes"},
        ["parallelism.reshard_after_forward_policy", "'always', 'never', 'default'"],
    ),
    "deredundancy needs ep": (
        {"parallelism.moe_token_dispatcher_type": "alltoall_deredundancy", "parallelism.expert_parallel": 2},
        ["parallelism.expert_parallel", "npu_nums_per_device", "alltoall_deredundancy"],
    ),
    "dispatcher type": (
        {"parallelism.moe_token_dispatcher_type": "allgather"},
        ["parallelism.moe_token_dispatcher_type", "alltoall"],
    ),
    "dp shard": ({"parallelism.data_parallel_shard": 0}, ["parallelism.data_parallel_shard", "-1"]),
    "tp positive": ({"parallelism.tensor_parallel": 0}, ["parallelism.tensor_parallel", "positive"]),
    "shard strategy": (
        {"parallelism.data_parallel_shard_strategy": "zero3"},
        ["parallelism.data_parallel_shard_strategy", "optim_grads_params"],
    ),
    "cp method": ({"parallelism.context_parallel_method": "ring"}, ["parallelism.context_parallel_method"]),
    "hybrid cp needs ulysses degree": (
        {"parallelism.context_parallel": 4, "parallelism.context_parallel_method": "hybrid"},
        ["parallelism.ulysses_degree_in_cp", "hybrid"],
    ),
    "ulysses divides cp": (
        {
            "parallelism.context_parallel": 4,
            "parallelism.context_parallel_method": "hybrid",
            "parallelism.ulysses_degree_in_cp": 3,
        },
        ["parallelism.ulysses_degree_in_cp", "divide"],
    ),
    "pp schedule": (
        {"parallelism.pipeline_parallel_schedule": "zb"},
        ["parallelism.pipeline_parallel_schedule"],
    ),
    "pp transport": (
        {"parallelism.pipeline_parallel_p2p_transport": "rdma"},
        ["parallelism.pipeline_parallel_p2p_transport"],
    ),
    "pp layers per stage length": (
        {"parallelism.pipeline_parallel": 2, "parallelism.pipeline_parallel_layers_per_stage": ["0-3"]},
        ["parallelism.pipeline_parallel_layers_per_stage", "one entry per pipeline stage"],
    ),
    "pp layers per stage chunks": (
        {
            "parallelism.pipeline_parallel": 2,
            "parallelism.pipeline_parallel_interleave_num": 2,
            "parallelism.pipeline_parallel_layers_per_stage": ["0", "1,2"],
        },
        ["parallelism.pipeline_parallel_layers_per_stage[0]", "interleave_num=2"],
    ),
    "pp layers per stage format": (
        {"parallelism.pipeline_parallel": 2, "parallelism.pipeline_parallel_layers_per_stage": ["0-1", "a"]},
        ["parallelism.pipeline_parallel_layers_per_stage[1]", "'start-end'"],
    ),
    "pp layers per stage order": (
        {
            "parallelism.pipeline_parallel": 2,
            "parallelism.pipeline_parallel_layers_per_stage": ["1-0", "2-3"],
        },
        ["parallelism.pipeline_parallel_layers_per_stage[0]", "layer_start"],
    ),
    "pp auto divisibility": (
        {"parallelism.pipeline_parallel": 3},
        ["parallelism.pipeline_parallel_layers_per_stage", "not divisible by total stages (3)"],
    ),
    # The optimizer's keys are its type's schema's (lmforge.optim.specs), with the original's messages.
    "betas length": ({"optimizer.betas": [0.9]}, ["optimizer.betas", "a list of 2 numbers"]),
    "betas below one": (
        {"optimizer.betas": [0.9, 1.0]},
        ["optimizer.betas", "index 1: 1.0, should be >= 0 and < 1"],
    ),
    "betas non-negative": ({"optimizer.betas": [-0.1, 0.9]}, ["optimizer.betas", "index 0: -0.1"]),
    "eps non-negative": ({"optimizer.eps": -1e-8}, ["optimizer.eps", "should be >= 0"]),
    "eps positive": ({"optimizer.eps": 0}, ["optimizer.eps: must be > 0"]),
    "weight decay non-negative": (
        {"optimizer.weight_decay": -0.1},
        ["optimizer.weight_decay", "should be >= 0"],
    ),
    "learning rate non-negative": ({"lr_scheduler.learning_rate": -1.0}, ["lr_scheduler.learning_rate"]),
    "profiler positive": ({"profiler.start_step": 0}, ["profiler.start_step", "must be positive"]),
    "profiler order": (
        {"profiler.start_step": 5, "profiler.end_step": 3},
        ["profiler.start_step", "less than or equal to", "end_step"],
    ),
    "profiler level": ({"profiler.profiler_level": 3}, ["profiler.profiler_level", "0, 1 or 2"]),
    "profiler ranks": ({"profiler.profiler_rank": [-1]}, ["profiler.profiler_rank"]),
    "recompute mode": ({"recompute.mode": "partial"}, ["recompute.mode", "'None', 'full', 'select'"]),
    "full needs layers": ({"recompute.mode": "full"}, ["recompute.full_recompute_layer", "required"]),
    "select needs modules": ({"recompute.mode": "select"}, ["recompute.select_module", "required"]),
    "layer spec syntax": (
        {"recompute.mode": "full", "recompute.full_recompute_layer": ["a-b"]},
        ["recompute.full_recompute_layer[0]", "invalid layer spec"],
    ),
    "layer spec range order": (
        {"recompute.mode": "full", "recompute.full_recompute_layer": ["3-1"]},
        ["recompute.full_recompute_layer[0]", "start must be <= end"],
    ),
    "layer specs ascending": (
        {"recompute.mode": "full", "recompute.full_recompute_layer": ["2", "0-1"]},
        ["recompute.full_recompute_layer", "strictly ascending"],
    ),
    "layer specs overlap": (
        {"recompute.mode": "full", "recompute.full_recompute_layer": ["0-2", "2-3"]},
        ["recompute.full_recompute_layer", "strictly ascending"],
    ),
    "layer id in range": (
        {"recompute.mode": "full", "recompute.full_recompute_layer": ["0-4"]},
        ["recompute.full_recompute_layer[0]", "out of range [0, 3]"],
    ),
    "select module layer range": (
        {"recompute.mode": "select", "recompute.select_module": {"mlp": ["7"]}},
        ["recompute.select_module['mlp'][0]", "out of range"],
    ),
    # Any non-empty string is a name pattern (exact, parts, glob or regex); one that matches no module
    # is refused by the run plan (tests/config/test_run_plan.py).
    "select module empty pattern": (
        {"recompute.mode": "select", "recompute.select_module": {"": ["0"]}},
        ["recompute.select_module", "non-empty module name pattern"],
    ),
    "select module is a mapping": (
        {"recompute.mode": "select", "recompute.select_module": ["mlp"]},
        ["recompute.select_module", "mapping"],
    ),
    "recompute_comm needs modules": ({"recompute_comm.enable": True}, ["recompute_comm.select_module"]),
    "recompute_comm layer specs": (
        {"recompute_comm.enable": True, "recompute_comm.select_module": {"attention.qkv": ["x"]}},
        ["recompute_comm.select_module['attention.qkv'][0]"],
    ),
    "swap prefetch at least one": (
        {"swap.default_prefetch": 0},
        ["swap.default_prefetch", "[1, num_layers - 1]"],
    ),
    "swap prefetch below layers": (
        {"swap.enable": True, "swap.default_prefetch": 4},
        ["swap.default_prefetch", "[1, 3]"],
    ),
    "swap prefetch past last layer": (
        {"swap.enable": True, "swap.default_prefetch": 2, "swap.layer_swap": [{"layers": ["0-2"]}]},
        ["swap.default_prefetch", "largest swapped layer"],
    ),
    "swap op name": ({"swap.op_swap": [{"layers": ["0"]}]}, ["swap.op_swap[0].op_name", "required"]),
    "swap layers": ({"swap.layer_swap": [{"layer": ["0"]}]}, ["swap.layer_swap[0]", "unknown keys"]),
    "swap layer range": (
        {"swap.layer_swap": [{"layers": ["9"]}]},
        ["swap.layer_swap[0].layers[0]", "out of range"],
    ),
    "moe interval bool": (
        {"monitor.moe_monitor.save_tokens_per_expert_interval": True},
        ["monitor.moe_monitor.save_tokens_per_expert_interval", "not bool"],
    ),
    "moe interval positive": (
        {"monitor.moe_monitor.save_tokens_per_expert_interval": 0},
        ["monitor.moe_monitor.save_tokens_per_expert_interval", "positive or None"],
    ),
    "moe layers bool": (
        {"monitor.moe_monitor.target_layers": False},
        ["monitor.moe_monitor.target_layers", "bool"],
    ),
    "moe layers int positive": (
        {"monitor.moe_monitor.target_layers": 0},
        ["monitor.moe_monitor.target_layers", "positive when it is an int"],
    ),
    "moe layers ints": (
        {"monitor.moe_monitor.target_layers": [0, "1"]},
        ["monitor.moe_monitor.target_layers", "only ints"],
    ),
    "moe layers non-negative": (
        {"monitor.moe_monitor.target_layers": [0, -1]},
        ["monitor.moe_monitor.target_layers", "non-negative"],
    ),
    "train_state selector": (
        {"monitor.train_state.local_norm": 3},
        ["monitor.train_state.local_norm", "bool, str, or list[str]"],
    ),
    "tensorboard interval": ({"monitor.tensorboard.log_interval": 0}, ["monitor.tensorboard.log_interval"]),
    "health threshold": (
        {"monitor.health_checkpoint.global_norm_skip_threshold": 0},
        ["monitor.health_checkpoint.global_norm_skip_threshold"],
    ),
    "checkpoint interval": ({"checkpoint.save_interleaved_steps": 0}, ["checkpoint.save_interleaved_steps"]),
    "checkpoint save_max": ({"checkpoint.save_max": 0}, ["checkpoint.save_max"]),
    "dataset workers": ({"train_dataset.num_parallel_workers": -1}, ["train_dataset.num_parallel_workers"]),
    "lora rank": ({"lora_config.lora_rank": 0}, ["lora_config.lora_rank"]),
    "lora dropout": ({"lora_config.lora_dropout": 1.0}, ["lora_config.lora_dropout"]),
    "lora regex": (
        {"lora_config.target_modules": "(["},
        ["lora_config.target_modules", "regular expression"],
    ),
    "model type required": (
        {"model": {"architectures": "Qwen3ForCausalLM"}},
        ["model.model_type", "required"],
    ),
    "architectures is a string": (
        {"model.architectures": ["Qwen3ForCausalLM"]},
        ["model.architectures", "must be a string"],
    ),
    "dataloader type required": (
        {"train_dataset.dataloader": {}},
        ["train_dataset.dataloader.type", "required"],
    ),
    "scheduler type required": ({"lr_scheduler": {"learning_rate": 0.1}}, ["lr_scheduler.type", "required"]),
    "callback type required": ({"callbacks": [{"log_interval": 3}]}, ["callbacks[0].type", "required"]),
    "section null": ({"checkpoint": None}, ["checkpoint", "null", "TrainConfig.checkpoint"]),
    "bool is not a number": ({"training.steps": True}, ["training.steps", "integer", "boolean"]),
    "bool is not a float": ({"optimizer.eps": False}, ["optimizer.eps", "number"]),
    "string is not an int": ({"training.seed": "42"}, ["training.seed", "integer", "str"]),
    "int is not a bool": ({"training.deterministic": 1}, ["training.deterministic", "boolean"]),
    "list of strings": (
        {"optimizer.weight_decay_exclude": "bias"},
        ["optimizer.weight_decay_exclude", "list"],
    ),
}


@pytest.mark.parametrize("case", sorted(RULES), ids=sorted(RULES))
def test_rule_is_enforced_with_the_key_named(case: str, base_config: dict[str, Any]) -> None:
    overrides, expected = RULES[case]
    message = _refused(base_config, overrides)
    for text in expected:
        assert text in message, f"{text!r} missing from: {message}"


def test_the_base_config_of_these_tests_is_valid(base_config: dict[str, Any]) -> None:
    cfg = load_config(base_config)
    assert cfg.model.layer_count() == 4


def test_layer_range_counts_mtp_layers(base_config: dict[str, Any]) -> None:
    base_config["model"].update(
        model_type="deepseek_v3",
        architectures="DeepseekV3ForCausalLM",
        num_attention_heads=4,
        num_nextn_predict_layers=1,
    )
    base_config["recompute"] = {"mode": "full", "full_recompute_layer": ["0-4"]}
    assert load_config(base_config).recompute.full_recompute_layer == ["0-4"]
    base_config["recompute"]["full_recompute_layer"] = ["0-5"]
    with pytest.raises(ConfigError, match=r"recompute\.full_recompute_layer\[0\].*out of range \[0, 4\]"):
        load_config(base_config)


def test_layer_specs_accept_ints_and_unquoted_ranges(base_config: dict[str, Any]) -> None:
    # YAML reads an unquoted [0-3] as the string "0-3"; a bare int is a single layer, as in the original.
    base_config["recompute"] = {"mode": "full", "full_recompute_layer": [0, "1-2", " 3 "]}
    assert load_config(base_config).recompute.mode == "full"


def test_layer_specs_are_not_range_checked_without_a_layer_count(base_config: dict[str, Any]) -> None:
    del base_config["model"]["num_hidden_layers"]
    base_config["recompute"] = {"mode": "full", "full_recompute_layer": ["0-99"]}
    assert load_config(base_config).recompute.full_recompute_layer == ["0-99"]


def test_valid_hybrid_context_parallel(base_config: dict[str, Any]) -> None:
    base_config["parallelism"] = {
        "context_parallel": 4,
        "context_parallel_method": "hybrid",
        "ulysses_degree_in_cp": 2,
    }
    assert load_config(base_config).parallelism.ulysses_degree_in_cp == 2


def test_valid_explicit_pipeline_split(base_config: dict[str, Any]) -> None:
    base_config["parallelism"] = {
        "pipeline_parallel": 2,
        "pipeline_parallel_interleave_num": 2,
        "pipeline_parallel_layers_per_stage": ["0,2", "1,3"],
    }
    assert load_config(base_config).parallelism.pipeline_parallel_layers_per_stage == ["0,2", "1,3"]
