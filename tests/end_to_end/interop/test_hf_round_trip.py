"""Hugging Face round trips that keep what the user has: the fp32 masters on export (`--dtype`), every
config.json field imported, the model section taken from config.json (`model.from_pretrained`), and an
export killed while publishing over an earlier one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import load_config, validate_section
from lmforge.errors import ConfigError
from lmforge.models import build_model, load_hf_pretrained, save_hf_pretrained
from lmforge.models.hf_io import read_safetensors_dir
from lmforge.train.checkpoint import Checkpointable, CheckpointManager

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _training_checkpoint(tmp_path, section):
    """A checkpoint as training writes it: fp32 master weights, config.yaml naming ``section``
    (whose compute_dtype may be bfloat16)."""
    torch.manual_seed(0)
    model = build_model(validate_section("model", {**section, "compute_dtype": "float32"}))
    manager = CheckpointManager(
        tmp_path / "ckpt", no_save_optim=True, save_max=0, config_dict={"model": section}
    )
    assert manager.save(Checkpointable(model=model), step=5)
    manager.close()
    return model


def test_export_dtype_is_honoured_from_the_fp32_masters(tmp_path, tiny_section):
    section = tiny_section("llama", compute_dtype="bfloat16")
    masters = {k: v.clone() for k, v in _training_checkpoint(tmp_path, section).state_dict().items()}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in masters.values())  # bf16 would lose bits
    base = ["convert", "--from", str(tmp_path / "ckpt"), "--no-tokenizer"]

    assert main([*base, "--to-hf", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["torch_dtype"] == "float32"
    assert {t.dtype for t in read_safetensors_dir(tmp_path / "fp32").values()} == {torch.float32}
    back = load_hf_pretrained(tmp_path / "fp32", dtype="float32").state_dict()
    assert all(torch.equal(back[k], masters[k]) for k in masters)  # bit for bit

    assert main([*base, "--to-hf", str(tmp_path / "default")]) == 0  # the run's compute dtype
    assert json.loads((tmp_path / "default" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in read_safetensors_dir(tmp_path / "default").values()} == {torch.bfloat16}
    back = load_hf_pretrained(tmp_path / "default", dtype="float32").state_dict()
    assert all(torch.equal(back[k], masters[k].bfloat16().float()) for k in masters)  # rounded once


def test_export_dtype_typo_is_refused(tmp_path, tiny_section, capsys):
    _training_checkpoint(tmp_path, tiny_section("llama"))
    args = ["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf"), "--dtype", "fp23"]
    assert main([*args, "--no-tokenizer"]) == 2
    assert "--dtype = 'fp23' is not a dtype" in capsys.readouterr().err


def test_import_keeps_fp32_weights_and_takes_the_dtype_from_config_json(tmp_path, tiny_section):
    torch.manual_seed(0)
    model = build_model(validate_section("model", tiny_section("llama")))
    save_hf_pretrained(model, tmp_path / "hf", dtype=torch.float32)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({**cfg, "torch_dtype": "bfloat16", "dtype": "bfloat16"})
    )
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ckpt")]) == 0
    assert (
        main(
            [
                "convert",
                "--from",
                str(tmp_path / "ckpt"),
                "--to-hf",
                str(tmp_path / "out"),
                "--no-tokenizer",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    back = load_hf_pretrained(tmp_path / "out", dtype="float32").state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    import yaml

    saved = yaml.safe_load((tmp_path / "ckpt" / "iteration_00000000" / "config.yaml").read_text())
    assert saved["model"]["compute_dtype"] == "bfloat16"


# config.json of a model as transformers writes it, with fields lmforge does not model.
QWEN3_JSON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
    "tie_word_embeddings": True,
    "bos_token_id": 7,
    "eos_token_id": 0,
    "use_cache": True,
    "sliding_window": None,
    "torch_dtype": "float32",
}


@pytest.fixture
def qwen3_dir(tmp_path):
    """A Hugging Face directory written by transformers itself from QWEN3_JSON."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in QWEN3_JSON.items() if k != "architectures"})
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path / "qwen3")
    return tmp_path / "qwen3"


def _written_config(qwen3_dir):
    return json.loads((qwen3_dir / "config.json").read_text())


def test_export_round_trips_every_imported_config_field(tmp_path, qwen3_dir):
    original = _written_config(qwen3_dir)
    assert main(["convert", "--from-hf", str(qwen3_dir), "--to", str(tmp_path / "ckpt")]) == 0
    assert (
        main(
            ["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"), "--no-tokenizer"]
        )
        == 0
    )
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {"rope_parameters", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "use_cache"} <= set(
        original
    )
    differ = {
        k: (v, exported.get(k, "<dropped>")) for k, v in original.items() if exported.get(k, "<dropped>") != v
    }
    assert set(differ) <= {"transformers_version"}, differ
    # transformers 4's spelling of the rope settings too
    assert exported["rope_theta"] == 500000.0 and exported["rope_scaling"]["factor"] == 2.0


def _yaml_with_model(tmp_path, base_config, model):
    import yaml

    cfg = dict(base_config, model=model)
    cfg["train_dataset"]["dataloader"]["config"]["seq_length"] = 64
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_from_pretrained_takes_the_model_section_from_config_json(tmp_path, qwen3_dir, base_config):
    path = _yaml_with_model(
        tmp_path,
        base_config,
        {"from_pretrained": str(qwen3_dir), "seq_length": 64, "compute_dtype": "float32"},
    )
    cfg = load_config(path)
    mc = cfg.model.typed.config
    assert (mc.model_type, mc.num_layers, mc.hidden_size, mc.head_dim) == ("qwen3", 2, 64, 16)
    assert (mc.rope_theta, mc.max_position_embeddings, mc.rms_norm_eps) == (500000.0, 512, 1e-05)
    assert mc.rope_scaling["factor"] == 2.0 and mc.tie_word_embeddings
    assert (mc.seq_length, mc.compute_dtype) == (64, torch.float32)  # training settings from the YAML
    # the saved section rebuilds the model without the directory (what checkpoints keep)
    saved = cfg.to_dict()
    assert saved["model"]["hf_config"]["bos_token_id"] == 7 and "from_pretrained" not in saved["model"]
    qwen3_dir.rename(qwen3_dir.with_name("moved"))
    assert load_config(saved).model.typed.config == mc
    qwen3_dir.with_name("moved").rename(qwen3_dir)
    # the weights come from checkpoint.load_path: without one, a warning says the start is fresh
    assert any("starts from freshly initialised weights" in w for w in cfg.warnings)
    raw = {
        "checkpoint.enable_save": False,
        "checkpoint.load_path": str(qwen3_dir),
        "checkpoint.no_load_optim": True,
    }
    with_weights = load_config(path, raw)
    assert not any("from_pretrained" in w for w in with_weights.warnings)


@pytest.mark.parametrize(
    ("key", "value", "theirs"),
    [
        ("rope_theta", 1000000.0, "500000.0"),
        ("max_position_embeddings", 2048, "512"),
        ("rms_norm_eps", 1.0e-6, "1e-05"),
    ],
)
def test_from_pretrained_refuses_numerics_that_disagree(tmp_path, qwen3_dir, base_config, key, value, theirs):
    path = _yaml_with_model(
        tmp_path, base_config, {"from_pretrained": str(qwen3_dir), "seq_length": 64, key: value}
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert f"model.{key}: the YAML gives {value!r}, config.json {theirs}" in str(exc.value)


def test_from_pretrained_alias_disagreeing_is_named(tmp_path, qwen3_dir, base_config):
    path = _yaml_with_model(
        tmp_path, base_config, {"from_pretrained": str(qwen3_dir), "seq_length": 64, "num_layers": 3}
    )
    with pytest.raises(ConfigError, match="model.num_layers: the YAML gives 3, config.json 2"):
        load_config(path)


def test_from_pretrained_missing_directory_is_a_config_error(tmp_path, base_config, capsys):
    path = _yaml_with_model(tmp_path, base_config, {"from_pretrained": str(tmp_path / "nowhere")})
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.from_pretrained" in err and "config.json does not exist" in err


def test_load_path_hf_dir_with_a_yaml_section_disagreeing_in_rope_theta(tmp_path, qwen3_dir):
    from lmforge.errors import CheckpointError
    from lmforge.models import load_hf_weights
    from lmforge.models.hf_io import section_from_hf_config

    section = section_from_hf_config(_written_config(qwen3_dir))
    load_hf_weights(build_model(validate_section("model", section)), qwen3_dir)  # the same model loads
    # the section as a user writes it out in the YAML: the rope base left at its default
    by_hand = {k: v for k, v in section.items() if k not in ("rope_parameters", "hf_config")}
    by_hand["rope_scaling"] = QWEN3_JSON["rope_scaling"]
    with pytest.raises(CheckpointError, match="rope_theta: checkpoint 500000.0 vs model 10000.0"):
        load_hf_weights(build_model(validate_section("model", by_hand)), qwen3_dir)
    with pytest.raises(CheckpointError, match="max_position_embeddings: checkpoint 512 vs model 2048"):
        load_hf_weights(
            build_model(
                validate_section("model", {**by_hand, "rope_theta": 5.0e5, "max_position_embeddings": 2048})
            ),
            qwen3_dir,
        )


_KILL_AT_PUBLISH = """
import os, signal, sys
real = os.replace
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if str(dst).endswith(".hf.old"):  # the earlier export moved aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from lmforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_an_export_killed_while_publishing_is_restored(tmp_path, tiny_section):
    """SIGKILL between the two renames of the publish leaves only .hf.old: the next reader or the next
    conversion puts it back; the killed run's temporary directory is removed."""
    torch.manual_seed(0)
    save_hf_pretrained(build_model(validate_section("model", tiny_section("llama"))), tmp_path / "ckpt_src")
    assert main(["convert", "--from-hf", str(tmp_path / "ckpt_src"), "--to", str(tmp_path / "ckpt")]) == 0
    export = ["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf"), "--no-tokenizer"]
    assert main(export) == 0
    before = (tmp_path / "hf" / "config.json").read_bytes()
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_AT_PUBLISH, *export], env=env, capture_output=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "hf").exists() and (tmp_path / ".hf.old").is_dir()
    assert list(tmp_path.glob(".hf.tmp-*"))  # the killed run's complete new export, never published

    load_hf_pretrained(tmp_path / "hf")  # a reader restores it
    assert (tmp_path / "hf" / "config.json").read_bytes() == before and not (tmp_path / ".hf.old").exists()

    os.rename(tmp_path / "hf", tmp_path / ".hf.old")  # the same state again, for the next conversion
    assert main(export) == 0
    assert (tmp_path / "hf" / "config.json").read_bytes() == before
    assert not (tmp_path / ".hf.old").exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_export_of_an_auto_dtype_run_defaults_to_the_fp32_masters(tmp_path, tiny_section):
    """compute_dtype: auto means bf16 on one machine and float32 on another: the export does not depend
    on which machine converts; it writes the masters."""
    masters = _training_checkpoint(tmp_path, tiny_section("llama", compute_dtype="auto")).state_dict()
    args = ["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf"), "--no-tokenizer"]
    assert main(args) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
    back = load_hf_pretrained(tmp_path / "hf", dtype="float32").state_dict()
    assert all(torch.equal(back[k], v) for k, v in masters.items())


def test_export_of_a_run_fine_tuned_from_an_hf_directory_writes_its_keys_back(tmp_path, qwen3_dir):
    """A run whose model section is written out in the YAML (no hf_config) and whose load_path is the
    Hugging Face directory: the export still carries that config.json's token ids and other keys."""
    from lmforge.models.hf_io import section_from_hf_config

    original = _written_config(qwen3_dir)
    section = {k: v for k, v in section_from_hf_config(original).items() if k != "hf_config"}
    run = {"model": section, "checkpoint": {"load_path": str(qwen3_dir), "no_load_optim": True}}
    manager = CheckpointManager(tmp_path / "ckpt", no_save_optim=True, save_max=0, config_dict=run)
    assert manager.save(Checkpointable(model=build_model(validate_section("model", section))), step=3)
    manager.close()
    args = ["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"), "--no-tokenizer"]
    assert main(args) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["use_cache"]) == (7, 0, True)
