"""Loading: files, YAML quirks, types, unknown keys, pass-through sections, attribute access."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from lmforge.config import dump_yaml, load_config
from lmforge.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"Config file not found: .*nope\.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "training:\n  steps: 10\n  seed: [1, 2\nmodel:\n  model_type: qwen3\n")
    with pytest.raises(ConfigError, match=r"YAML parse error in .*train\.yaml at line \d+, column \d+"):
        load_config(path)


def test_bad_indentation_gives_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "training:\n  steps: 10\n   seed: 3\n")
    with pytest.raises(ConfigError, match=r"at line 3"):
        load_config(path)


@pytest.mark.parametrize(("text", "what"), [("- a\n- b\n", "list"), ("", "empty document"), ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, what: str) -> None:
    with pytest.raises(ConfigError, match=rf"Expected a mapping .* got (a |an )?{what}"):
        load_config(_write(tmp_path, text))


def _nested(depth: int) -> str:
    lines = []
    for level in range(depth):
        lines.append("  " * level + f"k{level}:")
    lines.append("  " * depth + "leaf: 1")
    return "\n".join(lines) + "\n"


def test_mapping_depth_limit(tmp_path: Path, base_config: dict[str, Any]) -> None:
    # The top-level mapping, a pass-through top-level mapping and 8 nested mappings are 10 levels: the
    # limit. (The model section is typed per family, so the nesting lives in a key lmforge passes through.)
    base = yaml.safe_dump(base_config)
    ok = base + "x_nested:\n" + _indent(_nested(8), 1)
    assert load_config(_write(tmp_path, ok)).x_nested.k0.k1.k2.k3.k4.k5.k6.k7.leaf == 1
    too_deep = base + "x_nested:\n" + _indent(_nested(9), 1)
    with pytest.raises(ConfigError, match="YAML nesting depth 11 exceeds the maximum allowed value of 10"):
        load_config(_write(tmp_path, too_deep))


def _indent(text: str, levels: int) -> str:
    return "".join("  " * levels + line + "\n" for line in text.splitlines())


def test_sequences_do_not_count_towards_depth(tmp_path: Path, base_config: dict[str, Any]) -> None:
    base_config["x_deep"] = {"deep_list": [[[[[[[[[[[[1]]]]]]]]]]]]}
    assert load_config(_write(tmp_path, yaml.safe_dump(base_config))).x_deep.deep_list[0][0][0][0][0][0][0][0]


def test_exponent_without_dot_is_a_float(tmp_path: Path, base_config: dict[str, Any]) -> None:
    text = yaml.safe_dump(base_config) + "optimizer:\n  eps: 1e-8\n  adamw_eps: 1E-6\n"
    text = text.replace("learning_rate: 0.0001", "learning_rate: 3e-4\n  lr_end: 1e-7")
    text = text.replace("type: ConstantWarmUpLR", "type: CosineWithWarmUpLR")  # a scheduler with lr_end
    cfg = load_config(_write(tmp_path, text))
    assert cfg.optimizer.eps == 1e-8 and isinstance(cfg.optimizer.eps, float)  # as the file wrote it
    assert cfg.optimizer.adamw_eps == 1e-6
    assert cfg.optimizer.typed.hyper.eps == 1e-8
    assert cfg.lr_scheduler.learning_rate == 3e-4
    assert cfg.lr_scheduler.lr_end == 1e-7


def test_exponent_string_in_a_mapping_is_a_float(base_config: dict[str, Any]) -> None:
    base_config["optimizer"] = {"eps": "1e-8", "weight_decay": "0.1"}
    cfg = load_config(base_config)
    assert cfg.optimizer.typed.hyper.eps == 1e-8 and cfg.optimizer.typed.hyper.weight_decay == 0.1
    assert cfg.optimizer.eps == "1e-8"  # the section keeps what the file wrote (config.yaml writes it back)


def test_int_is_accepted_where_a_float_is_expected(base_config: dict[str, Any]) -> None:
    base_config["training"]["max_norm"] = 2
    cfg = load_config(base_config)
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)


def test_non_numeric_string_is_not_a_float(base_config: dict[str, Any]) -> None:
    base_config["training"]["max_norm"] = "one"
    with pytest.raises(ConfigError, match=r"training\.max_norm must be a number, got str"):
        load_config(base_config)


STRICT_SECTIONS = [
    ("checkpoint", "CheckpointConfig", "save_pth", "save_path"),
    ("training", "TrainingConfig", "global_batch_sze", "global_batch_size"),
    ("parallelism", "ParallelismConfig", "tensor_paralel", "tensor_parallel"),
    ("train_dataset", "TrainDatasetConfig", "drop_remaindr", "drop_remainder"),
    ("monitor", "MonitorConfig", "tensorbord", "tensorboard"),
    (
        "monitor.health_checkpoint",
        "HealthCheckpointConfig",
        "global_norm_skip_times",
        "global_norm_skip_time",
    ),
    ("monitor.train_state", "TrainStateConfig", "local_los", "local_loss"),
    ("monitor.tensorboard", "TensorboardConfig", "log_intervals", "log_interval"),
    ("monitor.moe_monitor", "MoeMonitorConfig", "target_layer", "target_layers"),
    ("context", "ContextConfig", "device_targe", "device_target"),
    ("profiler", "ProfilerConfig", "start_stp", "start_step"),
    ("recompute", "RecomputeConfig", "full_recompute_layers", "full_recompute_layer"),
    ("recompute_comm", "RecomputeCommConfig", "enabled", "enable"),
    ("swap", "SwapConfig", "default_prefech", "default_prefetch"),
    ("lora_config", "LoraConfig", "lora_ranks", "lora_rank"),
]


@pytest.mark.parametrize(("section", "cls", "typo", "right"), STRICT_SECTIONS)
def test_unknown_key_in_strict_section(
    base_config: dict[str, Any], section: str, cls: str, typo: str, right: str
) -> None:
    node = base_config
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[typo] = 1
    with pytest.raises(ConfigError) as info:
        load_config(base_config)
    message = str(info.value)
    assert f"Unknown configuration keys for {cls}: ['{typo}']" in message
    assert f"{section}.{typo}" in message
    assert f"did you mean {right}?" in message


def test_renamed_keys_of_older_versions_point_to_the_new_name(base_config: dict[str, Any]) -> None:
    base_config["monitor"] = {"tensorboard": {"tensorboard_dir": "tb"}}
    with pytest.raises(
        ConfigError, match=r"monitor\.tensorboard\.tensorboard_dir \(renamed: did you mean output_dir\?\)"
    ):
        load_config(base_config)


def test_eval_dataset_is_typed_like_train_dataset(base_config: dict[str, Any]) -> None:
    # No longer passed through: a section shaped wrongly is refused at load, naming its keys (issue 31).
    base_config["eval_dataset"] = {"anything": [1, 2]}
    with pytest.raises(
        ConfigError, match=r"eval_dataset\.dataloader: Field required.*eval_dataset\.anything"
    ):
        load_config(base_config)


def test_unknown_keys_pass_through_open_sections(base_config: dict[str, Any]) -> None:
    base_config["optimizer"] = {"type": "Muon", "momentum": 0.95, "ns_coefficients": [[[3.4, -4.7, 2.0], 8]]}
    base_config["lr_scheduler"].update(type="CosineWithWarmUpLR", lr_end=0.0)  # typed: a key of this type
    # typed per loader type: GPTDataset keys, all kept
    base_config["train_dataset"]["dataloader"]["config"] = {
        "seq_length": 32,
        "data_path": ["1", "a"],
        "split": "1",
    }
    base_config["model"]["rope_theta"] = 1.0e6  # typed per family: a key of qwen3
    base_config["callbacks"] = [{"type": "MyCallback", "log_interval": 10}]
    cfg = load_config(base_config)
    assert cfg.optimizer.momentum == 0.95
    assert cfg.optimizer.to_dict()["ns_coefficients"] == [[[3.4, -4.7, 2.0], 8]]
    assert cfg.lr_scheduler.lr_end == 0.0
    assert cfg.train_dataset.dataloader.config.seq_length == 32
    assert cfg.train_dataset.dataloader.to_dict()["config"] == {
        "seq_length": 32,
        "data_path": ["1", "a"],
        "split": "1",
    }
    assert cfg.train_dataset.dataloader.typed.config.data_path.prefixes == ["a"]
    assert cfg.model.rope_theta == 1.0e6 and cfg.model.typed.config.rope_theta == 1.0e6
    assert cfg.model.hidden_size == 64
    assert cfg.callbacks[0].log_interval == 10
    assert cfg.model.extras() == {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "seq_length": 32,
        "rope_theta": 1.0e6,
    }


def test_defaults_match_the_spec(base_config: dict[str, Any]) -> None:
    cfg = load_config(base_config)
    # An omitted checkpoint section trains without saving (the spec: omitted section = feature off).
    assert cfg.checkpoint.enable_save is False and cfg.checkpoint.save_path == ""
    given = load_config({**base_config, "checkpoint": {"save_path": "ck"}})
    assert given.checkpoint.enable_save is True and given.checkpoint.save_path == "ck"
    assert cfg.checkpoint.save_max == 5 and cfg.checkpoint.save_interleaved_steps == 1000
    assert cfg.checkpoint.prefix == "checkpoint" and cfg.checkpoint.save_global_layout_cache is True
    assert cfg.parallelism.data_parallel_shard == -1
    assert cfg.parallelism.data_parallel_shard_strategy == "optim_grads_params"
    assert cfg.parallelism.reshard_after_forward_policy == "default"
    assert cfg.parallelism.disable_gradient_division is True
    assert cfg.parallelism.npu_nums_per_device == 8
    assert cfg.parallelism.moe_token_dispatcher_type == "alltoall"
    adamw = cfg.optimizer.typed.hyper
    assert cfg.optimizer.type == "AdamW" and adamw.betas == (0.9, 0.95)
    assert adamw.eps == 1e-8 and adamw.weight_decay == 0.01
    assert adamw.accumulate_allreduce_grads_in_fp32 is True
    assert cfg.train_dataset.dataloader.typed.column_names == ["input_ids", "labels"]
    assert cfg.train_dataset.num_parallel_workers == 8 and cfg.train_dataset.prefetch_size == 1
    assert cfg.monitor.train_state.local_norm == "" and cfg.monitor.train_state.device_norm is False
    assert cfg.monitor.moe_monitor.save_tokens_per_expert_interval is None
    assert cfg.profiler.enable_profiling is False and cfg.profiler.with_stack is True
    assert cfg.recompute.mode == "None" and cfg.swap.default_prefetch == 1
    assert cfg.callbacks == [] and cfg.lora_config is None
    assert cfg.context.mode == 1 and cfg.output_dir == "./output"
    assert cfg.training.max_norm == 1.0 and cfg.training.seed == 42


def test_omitted_required_sections_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"training": {"steps": 3}})
    message = str(info.value)
    for name in ("lr_scheduler", "train_dataset", "model"):
        assert f"the {name} section is required" in message


def test_config_is_frozen(base_config: dict[str, Any]) -> None:
    cfg = load_config(base_config)
    with pytest.raises(pydantic.ValidationError):
        cfg.training.steps = 5  # type: ignore[misc]


def test_dict_like_access(base_config: dict[str, Any]) -> None:
    cfg = load_config(base_config)
    assert cfg["training"]["steps"] == 10
    assert cfg.model.get("missing", 7) == 7
    with pytest.raises(KeyError, match="'TrainingConfig' object has no key 'nope'"):
        cfg.training["nope"]


def test_input_mapping_is_not_modified(base_config: dict[str, Any]) -> None:
    import copy

    before = copy.deepcopy(base_config)
    load_config(base_config, ["training.steps=3"])
    assert base_config == before


def test_sequence_parallel_follows_tensor_parallel(base_config: dict[str, Any]) -> None:
    base_config["parallelism"] = {"tensor_parallel": 2}
    cfg = load_config(base_config)
    assert cfg.parallelism.sequence_parallel is True and cfg.warnings == ()
    base_config["parallelism"]["sequence_parallel"] = False
    cfg = load_config(base_config)
    assert cfg.parallelism.sequence_parallel is True
    assert any("parallelism.sequence_parallel" in w for w in cfg.warnings)


def test_recompute_mode_null_means_none(base_config: dict[str, Any]) -> None:
    base_config["recompute"] = {"mode": None}
    assert load_config(base_config).recompute.mode == "None"


def test_inert_fields_warn(base_config: dict[str, Any]) -> None:
    base_config["context"] = {"max_device_memory": "30GB", "mode": 1}
    base_config["lora_config"] = {"lora_rank": 4}
    warnings = load_config(base_config).warnings
    assert any(w.startswith("context.max_device_memory = '30GB' has no effect") for w in warnings)
    assert not any(w.startswith("lora_config") for w in warnings)  # LoRA is implemented (models/lora.py)
    assert not any(w.startswith("context.mode") for w in warnings)  # the default: nothing is ignored


def test_dump_yaml_round_trips(tmp_path: Path, base_config: dict[str, Any]) -> None:
    base_config["optimizer"] = {"eps": 1e-8, "note": "1e-8", "flag": "yes"}
    cfg = load_config(base_config)
    out = tmp_path / "resolved.yaml"
    text = dump_yaml(cfg, out)
    assert out.read_text(encoding="utf-8") == text
    again = load_config(out)
    assert again.to_dict() == cfg.to_dict()
    assert again.optimizer.note == "1e-8" and again.optimizer.flag == "yes"


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "training:\n  steps: 10\n  seed: 1\n  steps: 20\n")
    with pytest.raises(ConfigError, match=r"line 4.*duplicate key 'steps' \(first written at line 2\)"):
        load_config(path)


def test_merge_keys_may_be_overridden(tmp_path: Path, base_config: dict[str, Any]) -> None:
    text = yaml.safe_dump({k: v for k, v in base_config.items() if k != "training"})
    text += "defaults: &d {steps: 5, seed: 1}\ntraining:\n  <<: *d\n  steps: 9\n"
    cfg = load_config(_write(tmp_path, text))
    assert cfg.training.steps == 9 and cfg.training.seed == 1


def test_extras_named_like_pydantic_methods(base_config: dict[str, Any]) -> None:
    base_config["schema"] = "v2"  # a pass-through top-level key (model keys are typed per family)
    cfg = load_config(base_config)
    assert cfg.get("schema") == "v2" and cfg["schema"] == "v2"
    assert cfg.to_dict()["schema"] == "v2"


def test_unknown_top_level_keys_pass_through_with_a_warning(base_config: dict[str, Any]) -> None:
    base_config["trainig"] = {"steps": 5}
    # Typed like train_dataset (issue 31), and unused without eval_interval: said so.
    base_config["eval_dataset"] = {"dataloader": dict(base_config["train_dataset"]["dataloader"])}
    cfg = load_config(base_config)
    assert cfg.trainig.steps == 5 and cfg.training.steps == 10
    assert any(
        "'trainig' is not a section lmforge reads" in w and "did you mean training?" in w
        for w in cfg.warnings
    )
    assert any("eval_dataset is set but eval_interval is 0" in w for w in cfg.warnings)
    # A resolved config written back (a checkpoint's config.yaml) holds eval_dataset: null: nothing to say.
    base_config.pop("trainig")
    base_config["eval_dataset"] = None
    assert not [w for w in load_config(base_config).warnings if "eval_dataset" in w]


def test_fp32_accumulation_cannot_be_turned_off(base_config: dict[str, Any]) -> None:
    base_config["optimizer"] = {"accumulate_allreduce_grads_in_fp32": False}
    warnings = load_config(base_config).warnings
    said = [w for w in warnings if "accumulate_allreduce_grads_in_fp32" in w]
    # Said once, by the optimizer's schema (the key's one owner), and not for the value lmforge runs anyway.
    assert len(said) == 1 and said[0].startswith(
        "optimizer.accumulate_allreduce_grads_in_fp32: false has no effect"
    )
    base_config["optimizer"] = {"accumulate_allreduce_grads_in_fp32": True}
    assert not [w for w in load_config(base_config).warnings if "accumulate_allreduce" in w]


def test_union_type_errors_are_one_message(base_config: dict[str, Any]) -> None:
    base_config["parallelism"] = {"pipeline_parallel_layers_per_stage": 5}
    with pytest.raises(ConfigError) as info:
        load_config(base_config)
    message = str(info.value)
    assert "parallelism.pipeline_parallel_layers_per_stage must be a string or a list, got int (5)" in message
    assert "problems" not in message


def test_checkpoint_section_without_save_path_is_refused_at_load(base_config: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.save_path: save_path must be provided"):
        load_config({**base_config, "checkpoint": {"save_max": 2}})


@pytest.mark.parametrize(
    ("key", "value"), [("eval_interval", -1), ("eval_interval", "5"), ("eval_steps", 0), ("eval_steps", 1.5)]
)
def test_eval_keys_are_typed(base_config: dict[str, Any], key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config({**base_config, key: value})


def test_the_optimizer_schema_owns_every_optimizer_key(base_config: dict[str, Any]) -> None:
    # The spec's eps > 0 is the schema's rule now (the section no longer has one of its own), for
    # every eps of every type, with the original's text for a negative one.
    for section in ({"eps": 0}, {"type": "Muon", "adamw_eps": 0.0}, {"type": "LAMB", "eps": 0}):
        base_config["optimizer"] = section
        key = "adamw_eps" if "adamw_eps" in section else "eps"
        with pytest.raises(ConfigError, match=rf"optimizer\.{key}: must be > 0 .*NaN"):
            load_config(base_config)
    base_config["optimizer"] = {"eps": 1e-30}
    assert load_config(base_config).optimizer.typed.hyper.eps == 1e-30
    # An omitted key takes its type's default: Muon's Newton-Schulz eps and decay, not AdamW's.
    base_config["optimizer"] = {"type": "Muon"}
    cfg = load_config(base_config)
    assert (cfg.optimizer.typed.hyper.eps, cfg.optimizer.typed.hyper.weight_decay) == (1e-7, 0.1)
    assert cfg.optimizer.to_dict() == {"type": "Muon"}  # nothing the file did not write is saved
    base_config["optimizer"] = {"betas": [0.9, 0.95], "eps": "tiny"}
    with pytest.raises(ConfigError, match=r"optimizer\.eps: expected a number, got str \('tiny'\)"):
        load_config(base_config)


def test_the_loader_schema_owns_every_dataloader_key(base_config: dict[str, Any]) -> None:
    # The loader's schema refuses what the section used to refuse itself: strict, with the key named.
    base_config["train_dataset"]["dataloader"]["shuffle"] = "yes"
    with pytest.raises(
        ConfigError, match=r"train_dataset\.dataloader\.shuffle must be true or false; got 'yes'"
    ):
        load_config(base_config)
    base_config["train_dataset"]["dataloader"]["shuffle"] = True
    base_config["train_dataset"]["dataloader"]["column_names"] = "input_ids"
    with pytest.raises(ConfigError, match=r"train_dataset\.dataloader\.column_names"):
        load_config(base_config)
