"""load_config types model, optimizer and lr_scheduler per discriminator (lmforge.config.registry)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.config.registry import register_section_schema, section_values, typed_section
from lmforge.errors import ConfigError


def test_sections_are_typed_at_load(base_config: dict[str, Any]) -> None:
    from lmforge.lr import SchedulerSpec
    from lmforge.models.schema import TypedModel
    from lmforge.optim import OptimizerOptions

    cfg = load_config(base_config)
    assert isinstance(cfg.lr_scheduler.typed, SchedulerSpec) and cfg.lr_scheduler.typed.warmup_steps == 2
    assert isinstance(cfg.model.typed, TypedModel) and cfg.model.typed.config.hidden_size == 64
    assert isinstance(cfg.optimizer.typed, OptimizerOptions) and cfg.optimizer.typed.type == "AdamW"
    assert "CosineWithWarmUpLR" in section_values("lr_scheduler") and "qwen3" in section_values("model")


def test_errors_of_typed_sections_are_reported_together_at_load(base_config: dict[str, Any]) -> None:
    base_config["lr_scheduler"]["type"] = "CosineWithWarmupLR"
    base_config["model"]["num_hiden_layers"] = 2
    base_config["optimizer"] = {"type": "Adam"}
    with pytest.raises(ConfigError) as info:
        load_config(base_config)
    text = str(info.value)
    assert "3 problems" in text
    assert (
        "lr_scheduler.type: unknown scheduler 'CosineWithWarmupLR' (did you mean CosineWithWarmUpLR?)" in text
    )
    assert (
        "model.num_hiden_layers is not a key of model_type 'qwen3'. Did you mean 'num_hidden_layers'?" in text
    )
    assert "optimizer.type: Optimizer type Adam is not implemented yet" in text


def test_schema_warnings_are_config_warnings(base_config: dict[str, Any]) -> None:
    base_config["lr_scheduler"]["warmup_steps"] = 50  # longer than training.steps (10)
    base_config["model"]["torch_dtype"] = "bfloat16"
    warnings = " | ".join(load_config(base_config).warnings)
    assert "the warm-up (50 steps) is longer than training.steps (10)" in warnings
    assert "model.torch_dtype" in warnings


def test_registry_dispatch_catch_all_and_conflicts() -> None:
    seen: list[str] = []
    register_section_schema(
        "x_test", "Alpha", lambda s, p, c: seen.append(f"Alpha:{p}") or "a", noun="widget"
    )
    assert typed_section("x_test", "Alpha", {}, "x_test", {}) == "a" and seen == ["Alpha:x_test"]
    with pytest.raises(ValueError, match=r"x_test.type: unknown widget 'Alpah' \(did you mean Alpha\?\)"):
        typed_section("x_test", "Alpah", {}, "x_test", {})
    with pytest.raises(ValueError, match="already registered"):
        register_section_schema("x_test", "Alpha", lambda s, p, c: None)
    register_section_schema("x_test", "*", lambda s, p, c: "any")
    assert typed_section("x_test", "zzz", {}, "x_test", {}) == "any"
    assert typed_section("x_unregistered", "A", {}, "x", {}) is None


def test_import_lmforge_config_does_not_import_torch() -> None:
    # The torch-needing schemas (families, optimizers) register through providers on the first load.
    code = "import sys, lmforge.config; print('torch' in sys.modules)"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------
# train_dataset.dataloader, typed per loader type


def test_dataloader_is_typed_at_load_per_loader_type(base_config: dict[str, Any]) -> None:
    from lmforge.data.schema import MegatronLoader, TextLoader

    typed = load_config(base_config).train_dataset.dataloader.typed
    assert isinstance(typed, MegatronLoader) and typed.config.seq_length == 32 and typed.config.eod == 0
    assert typed.config.split_weights == [0.98, 0.02, 0.0] and typed.columns == ["input_ids", "labels"]
    base_config["train_dataset"]["dataloader"] = {
        "type": "TextDataLoader",
        "data_path": ["a.jsonl"],
        "tokenizer": "t",
    }
    typed = load_config(base_config).train_dataset.dataloader.typed
    # The schema's default column_names are the Megatron loader's; a text loader keeps its own.
    assert isinstance(typed, TextLoader) and typed.data_path.prefixes == ["a.jsonl"]
    assert typed.column_names == ["input_ids", "labels", "loss_mask", "position_ids"]
    assert (typed.tokenizer, typed.pack, typed.shuffle_buffer, typed.eod) == ("t", "concat", 10_000, None)


@pytest.mark.parametrize(
    ("loader", "named", "owner"),
    [
        (
            {"config": {"seq_length": 32, "data_path": ["d"], "split": "1", "sequence_len": 3, "spilt": "1"}},
            ["train_dataset.dataloader.config.sequence_len", "train_dataset.dataloader.config.spilt"],
            "are not GPTDataset settings",
        ),
        (
            {
                "type": "TextDataLoader",
                "data_path": ["a.jsonl"],
                "tokenizer": "t",
                "packk": "whole",
                "txt_key": "x",
            },
            ["train_dataset.dataloader.packk", "train_dataset.dataloader.txt_key"],
            "are not TextDataLoader settings",
        ),
        (
            {"type": "HFDataLoader", "path": "json", "data_files": "a.jsonl", "num_samples": 4, "batch": 2},
            ["train_dataset.dataloader.num_samples", "train_dataset.dataloader.batch"],
            "of HFDataLoader have no equivalent",
        ),
    ],
)
def test_every_unknown_dataloader_key_is_named_at_once(
    base_config: dict[str, Any], loader: dict[str, Any], named: list[str], owner: str
) -> None:
    base_config["train_dataset"]["dataloader"].update(loader)
    with pytest.raises(ConfigError) as info:
        load_config(base_config)
    text = str(info.value)
    assert owner in text and all(key in text for key in named), text


def test_dataloader_errors_are_reported_with_the_other_sections(base_config: dict[str, Any]) -> None:
    base_config["lr_scheduler"]["warmup_stpes"] = 3
    base_config["train_dataset"]["dataloader"]["type"] = "MindDataset"
    with pytest.raises(ConfigError) as info:
        load_config(base_config)
    text = str(info.value)
    assert "2 problems" in text and "lr_scheduler.warmup_stpes" in text
    assert "train_dataset.dataloader.type is 'MindDataset'" in text and "Unsupported dataloader type" in text


def test_dataloader_against_the_model_at_load(base_config: dict[str, Any]) -> None:
    base_config["model"]["seq_length"] = 64
    with pytest.raises(ConfigError, match=r"config\.seq_length \(32\) must equal model\.seq_length \(64\)"):
        load_config(base_config)
    base_config["model"].update(seq_length=32, vocab_size=100)
    base_config["train_dataset"]["dataloader"]["config"]["eod"] = 100
    with pytest.raises(ConfigError, match=r"config\.eod = 100 is not a token id .*model\.vocab_size = 100"):
        load_config(base_config)
    text = {"type": "TextDataLoader", "data_path": ["a.jsonl"], "tokenizer": "t", "seq_length": 16}
    base_config["train_dataset"]["dataloader"] = text
    with pytest.raises(
        ConfigError, match=r"dataloader\.seq_length \(16\) must equal model\.seq_length \(32\)"
    ):
        load_config(base_config)


def test_data_builder_takes_the_typed_section(base_config: dict[str, Any], monkeypatch: Any) -> None:
    # build_dataset builds from cfg.train_dataset as load_config typed it: no second parse.
    import lmforge.data.schema as schema
    from lmforge.data import build_dataset
    from lmforge.errors import DataError

    cfg = load_config(base_config)

    class ParsedAgain(RuntimeError):
        pass

    def parse_again(node: Any) -> Any:
        raise ParsedAgain("the builder parsed the dataloader section again")

    monkeypatch.setattr(schema, "type_dataloader", parse_again)
    with pytest.raises(DataError, match="data/none/train"):
        build_dataset(cfg.train_dataset)  # reaches the files: the typed section was used as is
    with pytest.raises(TypeError, match="validate_section"):
        build_dataset(cfg.train_dataset.to_dict())  # a mapping is the config's to validate, not the builder's


def test_an_hf_loaders_validation_set_is_read_from_its_typed_form(base_config: dict[str, Any]) -> None:
    # An HFDataLoader is typed as the TextDataLoader it translates to; eval_interval asks that form.
    hf = {
        "type": "HFDataLoader",
        "path": "json",
        "data_files": "a.jsonl",
        "tokenizer": "tok.json",
        "seq_length": 32,
    }
    base_config["train_dataset"]["dataloader"] = hf
    base_config["eval_interval"] = 5
    with pytest.raises(
        ConfigError, match=r"no validation set: give train_dataset\.dataloader\.validation_split"
    ):
        load_config(base_config)
    base_config["train_dataset"]["dataloader"] = {**hf, "validation_split": 0.1}
    cfg = load_config(base_config)
    assert cfg.train_dataset.dataloader.typed.type == "TextDataLoader"
    assert cfg.train_dataset.dataloader.typed.validation_split == 0.1
