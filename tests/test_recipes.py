"""Every recipe in configs/ validates and builds, matches what it claims to be, and runs as documented.

References: the spec's recipes as transcribed in tests/fixtures/spec_yamls (spec 000 §4.1/§4.2, spec
004's skeleton), the article's §6.5 template ranges (spec 001), and a Hugging Face transformers
Qwen3 model for the fine-tuning recipe's weight loading.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from lmforge.cli import main
from lmforge.config import load_config, validate_section
from lmforge.errors import CheckpointError
from lmforge.lr import build_scheduler
from lmforge.models import build_model, build_model_config
from lmforge.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SPEC = REPO / "tests" / "fixtures" / "spec_yamls"
RECIPES = ["pretrain_adamw", "muon_deepseek_v3", "finetune_qwen3_hf", "starting_template"]


def raw(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def documented_overrides(path: Path) -> list[str]:
    """The ``--set KEY=VALUE`` overrides a recipe's header comment gives for a CPU run."""
    command, inside = [], False
    for line in path.read_text().splitlines():
        text = line[1:].strip() if line.startswith("#") else ""
        inside = inside or text.startswith("lmforge train")
        if inside:
            command.append(text.rstrip("\\"))
            inside = text.endswith("\\")
    words = shlex.split(" ".join(command))
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]


def test_every_recipe_of_the_issue_is_shipped() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"demo", *RECIPES} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_checks_and_builds(path: Path, capsys: Any) -> None:
    assert main(["check", "--config", str(path)]) == 0, capsys.readouterr().err
    cfg = load_config(path)
    steps = int(cfg.training.steps)
    schedule = build_scheduler(cfg.lr_scheduler, steps)
    lrs = [schedule.lr_at(s) for s in range(0, steps, max(steps // 50, 1))]
    peak = float(cfg.lr_scheduler.learning_rate)
    assert all(math.isfinite(x) and 0.0 <= x <= peak * (1 + 1e-12) for x in lrs)
    assert max(lrs) == pytest.approx(peak, rel=0.05)
    model_cfg = build_model_config(cfg.model)
    assert model_cfg.vocab_size == cfg.model.vocab_size
    text_data = cfg.train_dataset.dataloader.type == "TextDataLoader"  # tokenized on the fly
    if text_data:
        assert model_cfg.seq_length == cfg.train_dataset.dataloader.seq_length
        assert cfg.train_dataset.dataloader.data_path == ["data/demo/chat.jsonl"]
    else:
        assert model_cfg.seq_length == cfg.train_dataset.dataloader.config.seq_length
    # Full size: meta tensors hold no memory; fp32 as the trainer keeps parameters (optimizers refuse bf16).
    model = build_model(cfg.model, device="meta").float()
    optimizer = build_optimizer(cfg.optimizer, model, schedule)
    assert type(optimizer).__name__ == cfg.optimizer.type
    in_groups = [id(p) for g in optimizer.param_groups for p in g["params"]]
    # The article's §5.6 trap: a parameter in two groups (tied embeddings) is updated twice.
    assert len(in_groups) == len(set(in_groups)) == sum(1 for _ in model.parameters())
    if not text_data:
        assert cfg.train_dataset.dataloader.config.train_data_path == ["data/demo/train"]


@pytest.mark.parametrize(
    "recipe, fixture", [("pretrain_adamw", "000_recipe_adamw"), ("muon_deepseek_v3", "000_recipe_muon")]
)
def test_spec_recipes_keep_the_spec_values(recipe: str, fixture: str) -> None:
    ours, spec = raw(REPO / "configs" / f"{recipe}.yaml"), raw(SPEC / f"{fixture}.yaml")
    for section in ("training", "optimizer", "lr_scheduler"):
        assert ours[section] == spec[section], section


def test_muon_recipe_model_is_the_skeleton_deepseek_v3() -> None:
    ours = raw(REPO / "configs" / "muon_deepseek_v3.yaml")["model"]
    skeleton = raw(SPEC / "004_skeleton.yaml")["model"]
    assert {k: ours[k] for k in skeleton} == skeleton
    model_cfg = build_model_config(load_config(REPO / "configs" / "muon_deepseek_v3.yaml").model)
    assert (
        model_cfg.multi_latent_attention and model_cfg.num_experts == 8 and model_cfg.num_experts_per_tok == 4
    )


def test_starting_template_is_within_the_articles_ranges() -> None:
    cfg = load_config(REPO / "configs" / "starting_template.yaml")
    opt, lr = cfg.optimizer, cfg.lr_scheduler
    assert opt.type == "AdamW" and lr.type == "CosineWithWarmUpLR"
    assert 2e-4 <= lr.learning_rate <= 3e-4
    assert 10 - 1e-9 <= lr.learning_rate / lr.lr_end <= 100 + 1e-9
    assert 0.01 <= lr.warmup_ratio <= 0.05
    assert opt.betas[0] == 0.9 and 0.99 <= opt.betas[1] <= 0.999
    assert opt.eps == 1e-6 and 0.01 <= opt.weight_decay <= 0.02
    assert cfg.training.max_norm == 1.0
    # "embedding and bias handled apart": they (and norms) must not decay; matrices must.
    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    small |= {"head_dim": 16, "num_hidden_layers": 2, "attention_bias": True}
    model = build_model(validate_section("model", {**cfg.model.to_dict(), **small}), device="meta").float()
    decay = {
        n: g["weight_decay"]
        for g in build_optimizer(validate_section("optimizer", opt), model, 1e-3).param_groups
        for n in g["param_names"]
    }
    assert decay["embedding.word_embeddings.weight"] == 0.0
    assert decay["output_layer.weight"] == opt.weight_decay  # untied here: a projection, it decays
    for name, wd in decay.items():
        if "norm" in name or name.endswith("bias"):
            assert wd == 0.0, name
        elif name.endswith("linear_qkv.weight") or name.endswith("linear_fc1.weight"):
            assert wd == opt.weight_decay, name


@pytest.mark.parametrize("recipe", ["pretrain_adamw", "muon_deepseek_v3"])
def test_documented_cpu_overrides_build_a_small_model(recipe: str) -> None:
    path = REPO / "configs" / f"{recipe}.yaml"
    overrides = documented_overrides(path)
    assert overrides, f"{path.name} documents no --set overrides for a CPU run"
    cfg = load_config(path, overrides)
    model = build_model(cfg.model, device="meta")
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert build_model_config(cfg.model).seq_length == cfg.train_dataset.dataloader.config.seq_length


# -- the fine-tuning recipe: a Hugging Face directory's weights are what training starts from ----------


TINY_QWEN3 = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def _finetune_setup(tmp_path: Path) -> tuple[Any, list[str]]:
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY_QWEN3)).float()
    hf.save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    from lmforge.data import IndexedDatasetWriter

    for split, docs in (("train", 40), ("valid", 4)):
        with IndexedDatasetWriter(tmp_path / "data" / split, np.int32) as w:
            for _ in range(docs):
                w.add_document([*rng.integers(1, 96, size=int(rng.integers(10, 40))).tolist(), 0])
    overrides = [f"model.{k}={v}" for k, v in TINY_QWEN3.items()] + [
        "model.seq_length=16",
        "model.compute_dtype=float32",
        "train_dataset.dataloader.config.seq_length=16",
        f"train_dataset.dataloader.config.train_data_path=[{tmp_path / 'data' / 'train'}]",
        f"train_dataset.dataloader.config.valid_data_path=[{tmp_path / 'data' / 'valid'}]",
        "train_dataset.num_parallel_workers=0",
        f"checkpoint.load_path={tmp_path / 'hf'}",
        "checkpoint.enable_save=false",
        "training.steps=1",
        "training.global_batch_size=2",
        "training.local_batch_size=2",
        "lr_scheduler.learning_rate=1.e-12",  # one step that leaves the weights as loaded
        "lr_scheduler.lr_end=0.0",
        "eval_interval=0",
    ]
    return hf, overrides


def test_finetune_recipe_starts_from_the_hf_weights(tmp_path: Path) -> None:
    from lmforge.train.builder import build_trainer

    hf, overrides = _finetune_setup(tmp_path)
    cfg = load_config(REPO / "configs" / "finetune_qwen3_hf.yaml", overrides)
    assert cfg.checkpoint.no_load_optim is True
    trainer = build_trainer(cfg, output_dir=tmp_path / "out", device="cpu")
    # Parameters are fp32 DTensors (FSDP2 over the one process): compare their full values.
    before = trainer.model.embedding.word_embeddings.weight.full_tensor().detach().clone()
    trainer.fit()
    ours = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
    theirs = hf.state_dict()
    assert not torch.allclose(before, theirs["model.embed_tokens.weight"])  # fresh init differs
    torch.testing.assert_close(
        ours["embedding.word_embeddings.weight"], theirs["model.embed_tokens.weight"].float()
    )
    torch.testing.assert_close(
        ours["decoder.layers.1.mlp.linear_fc2.weight"], theirs["model.layers.1.mlp.down_proj.weight"].float()
    )


def test_finetune_recipe_refuses_resuming_optimizer_state_from_hf(tmp_path: Path) -> None:
    from lmforge.train.builder import build_trainer

    _, overrides = _finetune_setup(tmp_path)
    cfg = load_config(
        REPO / "configs" / "finetune_qwen3_hf.yaml", [*overrides, "checkpoint.no_load_optim=false"]
    )
    trainer = build_trainer(cfg, output_dir=tmp_path / "out", device="cpu")
    with pytest.raises(CheckpointError, match=re.escape("no_load_optim")):
        trainer.fit()
