"""The original's real configuration files: ours accepts what it accepts and rejects what it rejects.

See /work/shared/reference/mindformers-yamls/README.md for which file the original accepts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.cli import main
from lmforge.config import load_config, read_raw
from lmforge.errors import ConfigError

# shared/ lies beside the checkout (here and in CI); /work/shared is the development layout.
REFERENCE = next(
    (
        root / "reference" / "mindformers-yamls"
        for root in (Path(__file__).resolve().parents[3] / "shared", Path("/work/shared"))
        if (root / "reference" / "mindformers-yamls").is_dir()
    ),
    Path("/work/shared/reference/mindformers-yamls"),
)
pytestmark = pytest.mark.skipif(not REFERENCE.is_dir(), reason="reference YAMLs are not on this machine")

TRAIN_CONFIG = "tests__st__test_ut__test_pynative__test_config__train_config"
DS3 = "tests__st__test_multi_cards_cases__test_pynative__test_models__test_deepseek3__pynative_ds3.yaml"
DS4 = "tests__st__test_multi_cards_cases__test_pynative__test_models__test_deepseek4__pynative_deepseek4.yaml"

# file -> world size to check it with. The ds3 files hold local 2 / global 2 as written (their
# multi-card tests lower local_batch_size to 1 first), so as written they fit one data-parallel rank.
ACCEPTED = {
    f"{TRAIN_CONFIG}.yaml": 2,
    "tests__st__test_ut__test_pynative__test_monitor__monitor_test.yaml": 1,
    "tests__st__test_ut__test_pynative__test_profiler__profiler_test.yaml": 1,
    DS3: 1,
    "tests__st__test_multi_cards_cases__test_pynative__test_models__test_deepseek3__pynarive_ds3@0fa8a0a68.yaml": 1,
    "mindspore-ai_docs__docs__mindformers__docs__source_zh_cn__example__quick_start__pynative_ds3.yaml": 1,
}

# file -> (class, keys) of the original's first error; ours names the same keys with dotted paths
REJECTED = {
    f"{TRAIN_CONFIG}@c3e5f4d94.yaml": ("ParallelismConfig", ["parallelism.hsdp_shard_size"]),
    f"{TRAIN_CONFIG}@11b9b7638.yaml": ("TensorboardConfig", ["monitor.tensorboard.tensorboard_dir"]),
    f"{TRAIN_CONFIG}@3c4f78187.yaml": ("TensorboardConfig", ["monitor.tensorboard.tensorboard_queue_size"]),
}


def test_the_readme_lists_every_file() -> None:
    listed = set(ACCEPTED) | set(REJECTED) | {DS4}
    assert listed == {p.name for p in REFERENCE.glob("*.yaml")}


# Files whose data section lmforge cannot read (a loader type it does not implement, a Megatron loader
# without its `config`), with the reason: the dataloader is typed at load, so `load_config`, `lmforge
# check` and `lmforge train` refuse them alike, before building anything. Every other section of these
# files loads (test_accepted_by_the_original_loads gives them a loader lmforge reads).
NOT_RUNNABLE = {
    f"{TRAIN_CONFIG}.yaml": "train_dataset.dataloader.config is required",
    "tests__st__test_ut__test_pynative__test_monitor__monitor_test.yaml": "MindDataset",
    "tests__st__test_ut__test_pynative__test_profiler__profiler_test.yaml": "MindDataset",
    DS3: "MindDataset",
    "tests__st__test_multi_cards_cases__test_pynative__test_models__test_deepseek3__pynarive_ds3@0fa8a0a68.yaml": (
        "MindDataset"
    ),
}


# A loader lmforge reads, for the files whose own loader it refuses (seq_length: the model's).
TEXT_LOADER = {"type": "TextDataLoader", "data_path": ["data/train.jsonl"], "tokenizer": "tokenizer.json"}


def _with_readable_data(raw: dict[str, Any]) -> dict[str, Any]:
    raw["train_dataset"]["dataloader"] = dict(TEXT_LOADER)
    return raw


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_by_the_original_loads(name: str) -> None:
    if name not in NOT_RUNNABLE:
        load_config(REFERENCE / name)
        return
    with pytest.raises(ConfigError, match=re.escape(NOT_RUNNABLE[name])):
        load_config(REFERENCE / name)
    load_config(_with_readable_data(read_raw(REFERENCE / name)[0]))


@pytest.mark.parametrize("name", sorted(set(ACCEPTED) - set(NOT_RUNNABLE)))
def test_accepted_by_the_original_is_accepted(name: str, capsys: Any) -> None:
    assert main(["check", "--config", str(REFERENCE / name), "--world-size", str(ACCEPTED[name])]) == 0, (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("name", sorted(NOT_RUNNABLE))
def test_schema_valid_but_not_runnable_is_refused_by_check_as_by_train(name: str, capsys: Any) -> None:
    assert main(["check", "--config", str(REFERENCE / name), "--world-size", str(ACCEPTED[name])]) == 2
    assert NOT_RUNNABLE[name] in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_rejected_by_the_original_is_rejected(name: str, capsys: Any) -> None:
    cls, keys = REJECTED[name]
    assert main(["check", "--config", str(REFERENCE / name)]) == 2
    err = capsys.readouterr().err
    assert f"Unknown configuration keys for {cls}" in err
    for key in keys:
        assert key in err


def test_deepseek_v4_only_its_model_type_is_refused() -> None:
    # The rest of the configuration is valid (Muon keys, rampup_batch_size, VPP, EP...): the model
    # section, typed per model_type at load, is the one problem.
    # (Its MindDataset loader is refused too; a loader lmforge reads leaves the model the one problem.)
    with pytest.raises(ConfigError) as info:
        load_config(_with_readable_data(read_raw(REFERENCE / DS4)[0]))
    text = str(info.value)
    assert "model.model_type = 'deepseek_v4' is not a known model type" in text and "problems" not in text


def test_deepseek_v4_model_type_is_refused_by_check(capsys: Any) -> None:
    assert main(["check", "--config", str(REFERENCE / DS4), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "deepseek_v4" in err and "qwen3" in err


# Layouts the original's multi-card tests derive from pynative_ds3.yaml (README "Layouts").
OVERLAYS = [
    (2, {"parallelism": {"expert_parallel": 2}}),
    (4, {"parallelism": {"tensor_parallel": 2}}),
    (4, {"parallelism": {"tensor_parallel": 2, "expert_parallel": 2}}),
    (4, {"parallelism": {"context_parallel": 2, "context_parallel_method": "colossal"}}),
    (
        4,
        {
            "parallelism": {
                "context_parallel": 2,
                "context_parallel_method": "ulysses",
                "context_parallel_async": True,
            }
        },
    ),
    (
        4,
        {
            "parallelism": {
                "tensor_parallel": 2,
                "expert_parallel": 2,
                "moe_token_dispatcher_type": "alltoall_deredundancy",
                "npu_nums_per_device": 2,
            }
        },
    ),
    (
        8,
        {
            "parallelism": {
                "context_parallel": 4,
                "context_parallel_method": "hybrid",
                "ulysses_degree_in_cp": 2,
            }
        },
    ),
]


@pytest.mark.parametrize(("world", "overlay"), OVERLAYS)
def test_multi_card_layouts_of_the_original(world: int, overlay: dict[str, Any]) -> None:
    base = _with_readable_data(yaml.safe_load((REFERENCE / DS3).read_text(encoding="utf-8")))
    base["training"].update(local_batch_size=1, steps=10, seed=1234, deterministic=True)
    for section, values in overlay.items():
        base[section].update(values)  # the original's tests do a per-section shallow update
    cfg = load_config(base)
    assert cfg.parallelism.sequence_parallel is True  # ds3 sets it; tensor_parallel > 1 needs it


def test_key_error_in_a_real_file_names_the_key(tmp_path: Path) -> None:
    text = (REFERENCE / f"{TRAIN_CONFIG}.yaml").read_text(encoding="utf-8")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("global_batch_size: 4", "global_batch_size: 0"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"training\.global_batch_size in config must be positive"):
        load_config(bad)
