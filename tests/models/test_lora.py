"""LoRA (``lora_config``): adapters, frozen base, merged and PEFT exports, checkpoints and exact resume."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config, validate_section
from lmforge.errors import ConfigError
from lmforge.models import build_model
from lmforge.models.lora import LoRALinear, apply_lora, init_lora_weights, lora_modules, merge_lora
from lmforge.train.builder import build_trainer
from lmforge.train.callbacks import read_metrics
from tiny_fp32 import TINY_RUN_MODEL
from train.test_train_cli import ADAMW, MUON, write_config

TARGETS = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"
LORA = [
    f"lora_config.target_modules={TARGETS}",
    "lora_config.exclude_layers=decoder.layers.1.mlp",
    "lora_config.lora_rank=4",
    "lora_config.lora_alpha=8",
    "model.compute_dtype=float32",
]


def _tiny_model():
    return build_model(
        validate_section("model", {**TINY_RUN_MODEL, "seq_length": 16, "compute_dtype": "float32"})
    )


def _randomise_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


def test_adapters_replace_selected_linears_and_freeze_the_rest():
    torch.manual_seed(0)
    model = _tiny_model()
    ids = torch.randint(0, 64, (2, 16))
    before = model(ids).logits
    names = apply_lora(
        model,
        validate_section(
            "lora_config",
            {"target_modules": TARGETS, "exclude_layers": r"decoder\.layers\.1\.mlp", "lora_rank": 4},
        ),
    )
    init_lora_weights(model, seed=1)
    assert names == [
        "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.0.mlp.linear_fc1",
        "decoder.layers.0.mlp.linear_fc2",
        "decoder.layers.1.self_attention.linear_qkv",
        "decoder.layers.1.self_attention.linear_proj",
    ]
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv, LoRALinear)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{n}.lora_{ab}.weight" for n in names for ab in "AB")
    # The base names are unchanged (HF loading, weight-decay patterns, checkpoints).
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in dict(model.named_parameters())
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert qkv.lora_A.weight.shape == (4, 32) and qkv.lora_B.weight.shape == (qkv.out_features, 4)
    assert (
        0.005 < qkv.lora_A.weight.std().item() < 0.02 and not qkv.lora_B.weight.any()
    )  # a_std 0.01, b_std 0
    assert torch.equal(model(ids).logits, before)  # B = 0: training starts at the base model


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"lora_rank": 4}, "lora_config.target_modules is empty"),
        ({"target_modules": "linear_qkv"}, "matches no linear module"),
        ({"target_modules": ".*linear_qkv", "exclude_layers": ".*"}, "matches no linear module"),
    ],
)
def test_bad_selection_is_a_clear_error(section, match):
    with pytest.raises(ConfigError, match=match):
        apply_lora(_tiny_model(), validate_section("lora_config", section))


def test_merged_model_gives_the_adapter_model_logits():
    torch.manual_seed(0)
    model = _tiny_model()
    apply_lora(
        model, validate_section("lora_config", {"target_modules": TARGETS, "lora_rank": 4, "lora_alpha": 16})
    )
    init_lora_weights(model, seed=1)
    _randomise_adapters(model)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
        merged = merge_lora(copy.deepcopy(model))
        assert not lora_modules(merged) and type(merged.decoder.layers[0].mlp.linear_fc1) is torch.nn.Linear
        assert sorted(merged.state_dict()) == sorted(_tiny_model().state_dict())
        out = merged(ids).logits
    assert (out - ref).abs().max().item() <= 1e-5
    assert (ref - _tiny_model()(ids).logits).abs().max().item() > 1e-3  # the adapters do change the model


def _lora_config(tmp_path, optimizer, steps, *extra):
    return load_config(write_config(tmp_path, optimizer, steps=steps), [*LORA, *extra])


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [ADAMW, MUON], ids=["adamw", "muon"])
def test_training_updates_only_the_adapters(tmp_path, optimizer):
    extra = ["optimizer.qk_clip_enabled=false"] if optimizer is MUON else []  # see the QK-Clip test
    trainer = build_trainer(_lora_config(tmp_path, optimizer, 4, "checkpoint.enable_save=false", *extra))
    model = trainer.model
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.fit()
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n  # bitwise unchanged
            assert p.grad is None, n  # no gradient kept
        else:
            assert not torch.equal(p, adapters[n]), n
    state_params = {id(p) for p in trainer.optimizer.state}
    assert state_params == {id(p) for p in model.parameters() if p.requires_grad}
    if optimizer is MUON:  # the adapters are routed through the Muon / AdamW groups like any matrix
        routes = {g.get("route") for g in trainer.optimizer.param_groups}
        assert "muon" in routes
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and len(set(losses)) > 1  # the adapters change the model's outputs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["load_path", "auto_resume"])
def test_lora_resume_is_bitwise_exact_and_checkpoint_has_small_optimizer(tmp_path, how):
    straight = tmp_path / "a"
    straight.mkdir()
    assert main(["train", "--config", write_config(straight, ADAMW, steps=4), *_sets(LORA)]) == 0
    split = tmp_path / "b"
    split.mkdir()
    cfg = write_config(split, ADAMW, steps=4)
    assert (
        main(
            [
                "train",
                "--config",
                cfg,
                *_sets([*LORA, "training.steps=2", "checkpoint.save_interleaved_steps=2"]),
            ]
        )
        == 0
    )
    # auto_resume (as an elastic restart): the same job finds its own small checkpoint in save_path.
    resume = f"checkpoint.load_path={split / 'ckpt'}" if how == "load_path" else "checkpoint.auto_resume=true"
    assert main(["train", "--config", cfg, *_sets([*LORA, resume])]) == 0
    a = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(straight / "run" / "metrics.jsonl")]
    b = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(split / "run" / "metrics.jsonl")]
    assert len(a) == 4 and a == b
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(split / "ckpt" / "iteration_00000002")).read_metadata().state_dict_metadata
    state_keys = [k for k in keys if k.startswith("optimizer.state.")]
    assert state_keys and all(".lora_" in k for k in state_keys)  # no optimizer state for the frozen base
    assert any(".lora_B." in k for k in keys if k.startswith("model."))
    # A small checkpoint: the adapters only, and the seed that rebuilds the frozen base (a fresh init).
    assert all(".lora_" in k for k in keys if k.startswith("model."))
    common = json.loads((split / "ckpt" / "iteration_00000002" / "common.json").read_text())
    assert common["lora_base"]["kind"] == "init" and isinstance(common["lora_base"]["seed"], int)


def _sets(overrides):
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


@pytest.mark.slow
def test_fine_tune_from_hf_then_merged_and_peft_exports_match(tmp_path, capsys):
    """HF base → LoRA training → `convert --to-hf` merged, and base + PEFT adapter loaded by peft."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from lmforge.models import save_hf_pretrained

    cfg = _lora_config(tmp_path, ADAMW, 3)
    torch.manual_seed(7)
    source = build_model(cfg.model)
    save_hf_pretrained(source, tmp_path / "hf_base")
    cfg = _lora_config(
        tmp_path,
        ADAMW,
        3,
        f"checkpoint.load_path={tmp_path / 'hf_base'}",
        "checkpoint.no_load_optim=true",
        "checkpoint.save_interleaved_steps=3",
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    model = trainer.model.eval()
    for name, p in source.named_parameters():  # the base came from the HF directory and stayed frozen
        # fp32 parameters sharded over the one process (FSDP2 at every world size)
        assert torch.equal(dict(model.named_parameters())[name].full_tensor(), p.float()), name
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ours = model(ids).logits
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "--from", str(ckpt), "--to-hf", str(tmp_path / "merged")]) == 0
    assert (
        main(
            [
                "convert",
                "--from",
                str(ckpt),
                "--to-hf",
                str(tmp_path / "base"),
                "--peft",
                str(tmp_path / "adapter"),
            ]
        )
        == 0
    )
    # generate rebuilds the model with the run's lora_config (the adapters are not dropped)
    argv = ["generate", "--checkpoint", str(ckpt), "--prompt", "t5 t7", "--max-new-tokens", "3"]
    assert main([*argv, "--temperature", "0"]) == 0
    capsys.readouterr()
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        assert (merged(ids).logits - ours).abs().max().item() <= 1e-5
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        base_logits = base(ids).logits
        peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        assert (peft_model(ids).logits - ours).abs().max().item() <= 1e-5
    assert (base_logits - ours).abs().max().item() > 1e-4  # the adapter is what makes the difference
    # The checkpoint holds the adapters and a checked record of the HF base, which is rebuilt from it.
    from lmforge.errors import CheckpointError
    from lmforge.models.lora import apply_lora
    from lmforge.train.checkpoint import load_model_weights

    it = ckpt / "iteration_00000003"
    common = json.loads((it / "common.json").read_text())
    record = common["lora_base"]
    assert record["kind"] == "hf" and record["path"] == str((tmp_path / "hf_base").resolve())
    weights = sorted((tmp_path / "hf_base").glob("*.safetensors"))[0]
    assert record["files"][weights.name]["size"] == weights.stat().st_size
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(it)).read_metadata().state_dict_metadata
    assert all(".lora_" in k for k in keys if k.startswith("model."))

    def fresh():
        m = build_model(cfg.model)
        apply_lora(m, cfg.lora_config)
        return m

    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the base flipped
    with pytest.raises(CheckpointError, match="weight files changed since"):
        load_model_weights(ckpt, fresh())
    weights.write_bytes(data)
    load_model_weights(ckpt, fresh())  # the original base is accepted again
    (tmp_path / "hf_base").rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match="no longer exists"):
        load_model_weights(ckpt, fresh())


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_under_fsdp2_matches_one_process(tmp_path):
    """2 gloo ranks (FSDP2 shards adapters and frozen base alike) give the 1-process losses."""
    from lmforge.models import save_hf_pretrained
    from torchrun import torchrun

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    torch.manual_seed(11)
    save_hf_pretrained(build_model(_lora_config(one, ADAMW, 3).model), tmp_path / "hf")  # one base for both
    start = [*LORA, f"checkpoint.load_path={tmp_path / 'hf'}", "checkpoint.no_load_optim=true"]
    assert main(["train", "--config", write_config(one, ADAMW, steps=3), *_sets(start)]) == 0
    torchrun(2, write_config(two, ADAMW, steps=3), *start, "checkpoint.save_interleaved_steps=3")
    a = [r["loss"] for r in read_metrics(one / "run" / "metrics.jsonl")]
    b = [r["loss"] for r in read_metrics(two / "run" / "metrics.jsonl")]
    assert len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    # The 2-rank checkpoint resumes on one process (adapters are resharded like any weight).
    out = tmp_path / "resume"
    sets = [*LORA, f"checkpoint.load_path={two / 'ckpt'}", "training.steps=4", f"output_dir={out}"]
    sets.append(f"checkpoint.save_path={out / 'ckpt'}")
    assert main(["train", "--config", write_config(two, ADAMW, steps=3), *_sets(sets)]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [4]


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_under_tensor_parallel_matches_one_process(tmp_path):
    """2 gloo ranks with tensor_parallel=2 (adapters on fused colwise and rowwise projections; A and B
    replicated, each rank using B's rows / A's columns of its shard) give the 1-process losses."""
    from lmforge.models import save_hf_pretrained
    from torchrun import torchrun

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    torch.manual_seed(12)
    save_hf_pretrained(build_model(_lora_config(one, ADAMW, 3).model), tmp_path / "hf")
    # lora_b_std > 0: the adapters change the output from the first step (both factors get gradients).
    start = [*LORA, "lora_config.lora_b_std=0.05", f"checkpoint.load_path={tmp_path / 'hf'}"]
    start += ["checkpoint.no_load_optim=true", "checkpoint.save_interleaved_steps=3"]
    assert main(["train", "--config", write_config(one, ADAMW, steps=3), *_sets(start)]) == 0
    torchrun(2, write_config(two, ADAMW, steps=3), *start, "parallelism.tensor_parallel=2")
    a = [(r["loss"], r["grad_norm"]) for r in read_metrics(one / "run" / "metrics.jsonl")]
    b = [(r["loss"], r["grad_norm"]) for r in read_metrics(two / "run" / "metrics.jsonl")]
    assert len(a) == len(b) == 3
    assert max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb)) < 1e-4, (a, b)
    # The adapters trained under TP equal the one-process ones (checkpoints reshard like any weight).
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(two / "ckpt" / "iteration_00000003")).read_metadata().state_dict_metadata
    assert all(".lora_" in k for k in keys if k.startswith("model."))
    merged = []
    for d in (one, two):
        out = tmp_path / f"merged_{d.name}"
        assert main(["convert", "--from", str(d / "ckpt"), "--to-hf", str(out), "--no-tokenizer"]) == 0
        merged.append(build_model(_lora_config(one, ADAMW, 3).model))
        from lmforge.models import load_hf_weights

        load_hf_weights(merged[-1], out)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert (merged[0](ids).logits - merged[1](ids).logits).abs().max().item() < 1e-4


def test_lora_model_loads_a_base_checkpoint_without_adapters(tmp_path):
    """Fine-tuning from an lmforge checkpoint of the base model: the adapters keep their fresh init."""
    from lmforge.train.checkpoint import Checkpointable, CheckpointManager, load_model_weights

    torch.manual_seed(3)
    base = _tiny_model()
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True, save_max=0)
    assert manager.save(Checkpointable(model=base), step=0)
    manager.close()
    model = _tiny_model()
    apply_lora(model, validate_section("lora_config", {"target_modules": ".*linear_qkv"}))
    init_lora_weights(model, seed=0)
    load_model_weights(tmp_path / "ckpt", model)
    ours = dict(model.named_parameters())
    for name, p in base.named_parameters():
        assert torch.equal(ours[name], p), name
    assert not ours["decoder.layers.0.self_attention.linear_qkv.lora_B.weight"].any()


def test_lora_checkpoint_rebuilds_its_lmforge_base_checkpoint_and_refuses_a_changed_one(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from lmforge.errors import CheckpointError
    from lmforge.train.checkpoint import (
        Checkpointable,
        CheckpointManager,
        load_model_weights,
        resolve_checkpoint,
    )
    from lmforge.train.checkpoint.lora import base_record

    def save(model, path, step, lora_base=None):
        manager = CheckpointManager(path, no_save_optim=True, save_max=0)
        manager.lora_base = lora_base
        assert manager.save(Checkpointable(model=model), step=step)
        manager.close()

    def fresh():
        torch.manual_seed(99)  # other base weights than the checkpoint's
        m = _tiny_model()
        apply_lora(m, validate_section("lora_config", {"target_modules": ".*linear_qkv"}))
        init_lora_weights(m, seed=0)
        return m

    torch.manual_seed(3)
    save(_tiny_model(), tmp_path / "base", 0)
    model = fresh()
    load_model_weights(tmp_path / "base", model)
    _randomise_adapters(model)
    save(model, tmp_path / "lora", 1, base_record(resolve_checkpoint(tmp_path / "base"), seed=0))
    keys = FileSystemReader(str(tmp_path / "lora" / "iteration_00000001")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no base weight in it
    again = fresh()
    load_model_weights(tmp_path / "lora", again)  # base from tmp_path/base, adapters from tmp_path/lora
    ours = again.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    torch.manual_seed(5)
    save(_tiny_model(), tmp_path / "base", 0)  # the base checkpoint re-saved with other weights
    with pytest.raises(CheckpointError, match="weight files changed since"):
        load_model_weights(tmp_path / "lora", fresh())


def test_a_lora_checkpoint_is_not_loaded_into_a_model_without_adapters(tmp_path):
    from lmforge.errors import CheckpointError
    from lmforge.train.checkpoint import Checkpointable, CheckpointManager, load_model_weights

    torch.manual_seed(4)
    model = _tiny_model()
    apply_lora(model, validate_section("lora_config", {"target_modules": ".*linear_proj"}))
    init_lora_weights(model, seed=0)
    _randomise_adapters(model)
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True, save_max=0)
    assert manager.save(Checkpointable(model=model), step=0)
    manager.close()
    with pytest.raises(CheckpointError, match="holds LoRA adapters"):
        load_model_weights(tmp_path / "ckpt", _tiny_model())  # would silently drop the adapters
    again = _tiny_model()
    apply_lora(again, validate_section("lora_config", {"target_modules": ".*linear_proj"}))
    load_model_weights(tmp_path / "ckpt", again)
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lora_config.target_modules=nothing_matches", "matches no linear module"),
        (
            "parallelism.pipeline_parallel=2",
            "lora_config cannot be combined with parallelism.pipeline_parallel",
        ),
    ],
)
def test_lmforge_check_reports_lora_problems_before_building(tmp_path, capsys, override, message):
    cfg = write_config(tmp_path, ADAMW, steps=2)
    argv = ["check", "--config", cfg, *_sets([*LORA, override])]
    if "pipeline_parallel" in override:
        argv += ["--world-size", "2"]
    assert main(argv) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # QK-norm gains / q,k projection rows
def test_muon_qk_clip_on_a_frozen_base_is_refused(tmp_path, capsys, family):
    """QK-Clip would rescale frozen weights (and ignore the adapters): refused, with the way out."""
    cfg = write_config(tmp_path, MUON, steps=2)
    model = [f"model.model_type={family}", f"model.architectures={family.capitalize()}ForCausalLM"]
    assert main(["check", "--config", cfg, *_sets([*LORA, *model])]) != 0
    assert "set optimizer.qk_clip_enabled: false" in capsys.readouterr().err
    assert main(["check", "--config", cfg, *_sets([*LORA, *model, "optimizer.qk_clip_enabled=false"])]) == 0
