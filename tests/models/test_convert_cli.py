"""``lmforge convert`` both ways, through the CLI entry point, in both checkpoint forms."""

from __future__ import annotations

import pytest
import torch

from lmforge.cli import main
from lmforge.config import validate_section
from lmforge.models import load_hf_pretrained


@pytest.mark.parametrize("form", ["dcp", "safetensors"])
def test_convert_hf_to_lmforge_and_back(tmp_path, make_hf_model, form):
    hf = make_hf_model("qwen3")
    hf.save_pretrained(tmp_path / "hf_in")
    assert (
        main(
            [
                "convert",
                "--from-hf",
                str(tmp_path / "hf_in"),
                "--to",
                str(tmp_path / "ckpt"),
                "--format",
                form,
            ]
        )
        == 0
    )
    if form == "dcp":
        assert (tmp_path / "ckpt" / "iteration_00000000" / ".metadata").is_file()
    export = ["convert", "--to-hf", str(tmp_path / "hf_out"), "--from", str(tmp_path / "ckpt")]
    assert main([*export, "--no-tokenizer"]) == 0
    a = load_hf_pretrained(tmp_path / "hf_in").state_dict()
    b = load_hf_pretrained(tmp_path / "hf_out").state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_convert_needs_one_direction(capsys):
    assert main(["convert", "--from-hf", "x"]) == 2
    assert "--from-hf DIR --to CKPT_DIR" in capsys.readouterr().err


def test_convert_missing_hf_dir_is_a_user_error(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(tmp_path / "nope"), "--to", str(tmp_path / "c")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err


def test_load_hf_weights_into_existing_model_and_mismatch_error(tmp_path, make_hf_model):
    from lmforge.errors import CheckpointError
    from lmforge.models import build_model, load_hf_weights

    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    section = {
        "model_type": "llama",
        "architectures": "LlamaForCausalLM",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "compute_dtype": "float32",
    }
    model = build_model(validate_section("model", section))
    load_hf_weights(model, tmp_path)
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert (model(ids).logits - hf(input_ids=ids).logits).abs().max() <= 1e-4
    with pytest.raises(CheckpointError, match="num_layers: checkpoint 2 vs model 3"):
        load_hf_weights(build_model(validate_section("model", {**section, "num_hidden_layers": 3})), tmp_path)


def test_model_section_from_the_config_loader():
    from pathlib import Path

    from lmforge.config import load_config
    from lmforge.models import build_model_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    assert build_model_config(cfg.model).model_type == cfg.model.to_dict()["model_type"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--config", "train.yaml"], "--config only applies to an export"),
        (["--max-shard-size", "1GB"], "--max-shard-size only applies to an export"),
        (["--tokenizer", "tok.json"], "--tokenizer only applies to an export"),
        (["--no-tokenizer"], "--no-tokenizer only applies to an export"),
        (["--chat-template", "t.jinja"], "--chat-template only applies to an export"),
    ],
)
def test_an_export_flag_given_with_an_import_is_refused_not_ignored(tmp_path, capsys, extra, needle):
    # Before: each of these was silently ignored by --from-hf DIR --to CKPT_DIR (exit 0).
    argv = ["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "c"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--format", "safetensors"], "--format chooses the lmforge checkpoint written by an import"),
        (["--tokenizer", "tok.json", "--no-tokenizer"], "give one of them"),
    ],
)
def test_a_flag_an_export_would_ignore_is_refused(tmp_path, capsys, extra, needle):
    argv = ["convert", "--to-hf", str(tmp_path / "out"), "--from", str(tmp_path / "ckpt"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"\xdd\xff{{ messages }}", "cannot read it ('utf-8' codec"),  # was a UnicodeDecodeError traceback
        (b"{% for m in %}", "is not a valid Jinja template"),  # was written into the export unchecked
    ],
)
def test_a_bad_chat_template_file_is_refused_before_loading(tmp_path, capsys, content, needle):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "t.jinja").write_bytes(content)
    argv = ["convert", "--to-hf", str(tmp_path / "out"), "--from", str(tmp_path / "ckpt")]
    assert main([*argv, "--chat-template", str(tmp_path / "t.jinja")]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {tmp_path / 't.jinja'}" in err and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
